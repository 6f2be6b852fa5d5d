"""Load on the API while a job trains: N concurrent clients poll job, events and metrics for a while.

    python -m benchmarks.service.load --clients 50 --seconds 60 --api-processes 2 --runs 3

Starts the embedded service (`fusetune serve`: API + worker + SQLite) on a temporary data directory, starts a
long training job of the bundled tiny model, then measures every request's latency. Writes the section "load" of
benchmarks/results/<machine>-service.json: the latency of every request of every run pooled, and each run's own
numbers (runs on a shared 2-core machine vary by 10-20%). Goal: 0 errors and p99 < 100 ms on the
CPU machine.

Each client keeps one connection and sends its next request as soon as the last one is answered (no pause), so
the latency is about clients / requests per second: the p99 goal is a throughput goal.

The clients share the machine with the server, so their own CPU time counts against it: aiohttp (the default)
costs about 0.2 ms of CPU per request on the 2-core CPU machine, httpx about 1.9 ms, which alone held httpx
clients to about 500 requests/s against a server that answered instantly. `--client httpx` is kept to compare
with earlier results. The results also record the load average before the run and the CPU time each process
used while the clients ran.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks import harness

RESULTS = harness.Benchmark("load", topic="service")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


ROUTES = ("job", "events", "metrics")


def _paths(job_id: str) -> list[tuple[str, str]]:
    return [("job", f"/v1/fine_tuning/jobs/{job_id}"), ("events", f"/v1/fine_tuning/jobs/{job_id}/events"),
            ("metrics", f"/v1/fine_tuning/jobs/{job_id}/metrics")]  # fmt: skip


async def _poll(
    get: Callable[[str], Awaitable[int]],
    failures: tuple[type[BaseException], ...],
    job_id: str,
    stop_at: float,
    latencies: dict,
    errors: list,
) -> None:
    """One client: the job's routes in turn, the next request as soon as the last is answered."""
    routes = _paths(job_id)
    i = 0
    while time.monotonic() < stop_at:
        name, path = routes[i % len(routes)]
        i += 1
        start = time.perf_counter()
        try:
            status = await get(path)
            latencies[name].append(time.perf_counter() - start)
            if status != 200:
                errors.append(f"{path}: {status}")
        except failures as exc:
            errors.append(f"{path}: {type(exc).__name__}")


async def _httpx_client(
    base_url: str, headers: dict, job_id: str, stop_at: float, latencies: dict, errors: list
) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as client:

        async def get(path: str) -> int:
            return (await client.get(path)).status_code

        await _poll(get, (httpx.HTTPError,), job_id, stop_at, latencies, errors)


async def _aiohttp_client(
    base_url: str, headers: dict, job_id: str, stop_at: float, latencies: dict, errors: list
) -> None:
    import aiohttp

    # One connection per client, as with httpx: each client is one user polling its job.
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(
        base_url, headers=headers, connector=connector, timeout=timeout
    ) as client:

        async def get(path: str) -> int:
            async with client.get(path) as response:
                await response.read()
            return response.status

        await _poll(get, (aiohttp.ClientError, TimeoutError), job_id, stop_at, latencies, errors)


CLIENTS = {"aiohttp": _aiohttp_client, "httpx": _httpx_client}


async def _load(client_kind: str, base_url: str, headers: dict, job_id: str, clients: int, seconds: float):
    latencies: dict[str, list[float]] = {name: [] for name in ROUTES}
    errors: list[str] = []
    stop_at = time.monotonic() + seconds
    client = CLIENTS[client_kind]
    await asyncio.gather(
        *[client(base_url, headers, job_id, stop_at, latencies, errors) for _ in range(clients)]
    )
    return latencies, errors


def _cpu_seconds(process: Any) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _service_processes(server: Any) -> dict[str, list[Any]]:
    """The server (with any API worker processes), its embedded worker and the training processes, by role."""
    roles: dict[str, list[Any]] = {"server": [server], "worker": [], "training": []}
    for child in server.children(recursive=True):
        command = " ".join(child.cmdline())
        if "fusetune.worker.train" in command or "torch.distributed.run" in command:
            roles["training"].append(child)
        elif "fusetune.cli worker" in command:
            roles["worker"].append(child)
        else:
            roles["server"].append(child)
    return roles


def _cpu_by_role(roles: dict[str, list[Any]]) -> dict[str, float]:
    import psutil

    totals = {}
    for role, processes in roles.items():
        total = 0.0
        for process in processes:
            try:
                total += _cpu_seconds(process)
            except psutil.NoSuchProcess:
                pass
        totals[role] = total
    return totals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--machine", default="cpu", help="slug for the results file name")
    parser.add_argument("--out", type=Path, default=harness.RESULTS_DIR, help="folder of the results file")
    parser.add_argument(
        "--api-processes",
        type=int,
        default=1,
        help="HTTP API processes of the server (FUSETUNE_API_PROCESSES)",
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="repeat with a fresh service and job; latencies are pooled"
    )
    parser.add_argument(
        "--client", choices=sorted(CLIENTS), default="aiohttp", help="HTTP client of the load"
    )
    args = parser.parse_args(argv)

    runs, latencies, errors = [], {name: [] for name in ROUTES}, []
    for _ in range(args.runs):
        load_average_before = os.getloadavg()
        root = Path(tempfile.mkdtemp(prefix="fusetune-load-"))
        try:
            run, run_latencies, run_errors = _run(args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        run["load_average_before"] = [round(x, 2) for x in load_average_before]
        runs.append(run)
        errors += run_errors
        for name in ROUTES:
            latencies[name] += run_latencies[name]
    result = _summary(args, runs, latencies, errors)
    print(render_markdown(result))
    print(f"wrote {RESULTS.write(args.out, args.machine, result)}")


def _rows(latencies: dict[str, list[float]]) -> list[dict]:
    everything = [x for values in latencies.values() for x in values]
    rows = []
    for name, values in {"all": everything, **latencies}.items():
        rows.append({"route": name, "requests": len(values), "p50_ms": 1000 * statistics.median(values),
                     "p99_ms": 1000 * _percentile(values, 0.99), "max_ms": 1000 * max(values)})  # fmt: skip
    return rows


def _run(args: argparse.Namespace, root: Path) -> tuple[dict, dict[str, list[float]], list[str]]:
    import psutil

    from fusetune.demo.assets import TRAIN_FILE, build_tiny_model
    from tests.services import running_service

    build_tiny_model(root / "data" / "models" / "tiny-llama")
    with running_service(
        root / "data", extra_env={"FUSETUNE_API_PROCESSES": str(args.api_processes)}
    ) as service:
        training = service.upload(TRAIN_FILE).json()["id"]
        job = service.client.post("/v1/fine_tuning/jobs", json={
            "model": "tiny-llama", "training_file": training,
            "hyperparameters": {"n_epochs": 100, "batch_size": 16, "n_gpus": 1}}).json()  # fmt: skip
        deadline = time.monotonic() + 120
        while service.client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] != "running":
            if time.monotonic() > deadline:
                raise TimeoutError("the job did not start")
            time.sleep(0.5)
        while not service.client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics").json()["data"]:
            time.sleep(0.5)
        roles = _service_processes(psutil.Process(service.process.pid))
        load_average_at_start = os.getloadavg()
        cpu_before = {**_cpu_by_role(roles), "clients": _cpu_seconds(psutil.Process())}
        started = time.monotonic()
        latencies, errors = asyncio.run(
            _load(args.client, service.base_url, {"Authorization": f"Bearer {service.api_key}"}, job["id"],
                  args.clients, args.seconds)
        )  # fmt: skip
        elapsed = time.monotonic() - started
        cpu_after = {**_cpu_by_role(roles), "clients": _cpu_seconds(psutil.Process())}
        status = service.client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"]
        metric_points = len(service.client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics").json()["data"])
        service.client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")

    requests = sum(len(values) for values in latencies.values())
    # Cores each part of the machine kept busy while the clients ran (2.0 = both cores of the CPU machine).
    cores_used = {role: round((cpu_after[role] - cpu_before[role]) / elapsed, 3) for role in cpu_before}
    run = {
        "load_average_at_load_start": [round(x, 2) for x in load_average_at_start],
        "job_status_during_load": status, "metric_points_at_end": metric_points, "errors": len(errors),
        "requests_per_s": requests / args.seconds, "cores_used": cores_used,
        "server_cpu_ms_per_request": 1000 * cores_used["server"] * elapsed / requests,
        "client_cpu_ms_per_request": 1000 * cores_used["clients"] * elapsed / requests,
        "all": _rows(latencies)[0],
    }  # fmt: skip
    return run, latencies, errors


def _summary(args: argparse.Namespace, runs: list[dict], latencies: dict, errors: list[str]) -> dict:
    return {
        "machine": args.machine, "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d"), "clients": args.clients, "seconds": args.seconds, "client": args.client,
        "api_processes": args.api_processes, "errors": len(errors), "error_samples": errors[:10],
        "requests_per_s": statistics.mean(run["requests_per_s"] for run in runs),
        "rows": _rows(latencies), "runs": runs,
        "command": f"python -m benchmarks.service.load --clients {args.clients} --seconds {args.seconds:g}"
                   + (f" --client {args.client}" if args.client != "aiohttp" else "")
                   + (f" --api-processes {args.api_processes}" if args.api_processes != 1 else "")
                   + (f" --runs {len(runs)}" if len(runs) != 1 else ""),
    }  # fmt: skip


def render_markdown(result: dict[str, Any]) -> str:
    processes = f"{result['api_processes']} API process{'es' if result['api_processes'] > 1 else ''}"
    runs = result["runs"]
    lines = [f"# API under load while a job trains ({result['machine']}, {result['cpu_count']} cores, {result['date']})", "",
             f"`{result['command']}` — {result['clients']} {result['client']} clients for {result['seconds']:g} s against "
             f"{processes}, {len(runs)} run{'s' if len(runs) > 1 else ''} (each a fresh service and job), "
             f"{result['requests_per_s']:.0f} requests/s, errors: {result['errors']}", "",
             "Latency of every request of every run:", "",
             "| route | requests | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['route']} | {r['requests']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} |"
              for r in result["rows"]]  # fmt: skip
    lines += ["", "Each run:", "", "| run | requests/s | p50 ms | p99 ms | load average at start (1 min) | cores busy: "
              "server, training, clients | server CPU ms per request | metric points at the end |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, run in enumerate(runs, 1):
        cores = run["cores_used"]
        lines.append(f"| {i} | {run['requests_per_s']:.0f} | {run['all']['p50_ms']:.1f} | {run['all']['p99_ms']:.1f} "
                     f"| {run['load_average_at_load_start'][0]} | {cores['server']:.2f}, {cores['training']:.2f}, "
                     f"{cores['clients']:.2f} | {run['server_cpu_ms_per_request']:.2f} | {run['metric_points_at_end']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
