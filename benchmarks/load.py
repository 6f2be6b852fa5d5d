"""Load on the API while a job trains: N concurrent clients poll job, events and metrics for a while.

    python benchmarks/load.py --clients 50 --seconds 60

Starts the embedded service (`fusetune serve`: API + worker + SQLite) on a temporary data directory, starts a
long training job of the bundled tiny model, then measures every request's latency. Writes
benchmarks/results/<machine>-load.json and a markdown twin. Goal: 0 errors and p99 < 100 ms on the CPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusetune.demo.assets import TRAIN_FILE, build_tiny_model  # noqa: E402
from tests.services import running_service  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _client(
    base_url: str, headers: dict, job_id: str, stop_at: float, latencies: dict, errors: list
) -> None:
    routes = [("job", f"/v1/fine_tuning/jobs/{job_id}"), ("events", f"/v1/fine_tuning/jobs/{job_id}/events"),
              ("metrics", f"/v1/fine_tuning/jobs/{job_id}/metrics")]  # fmt: skip
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as client:
        i = 0
        while time.monotonic() < stop_at:
            name, path = routes[i % len(routes)]
            i += 1
            start = time.perf_counter()
            try:
                response = await client.get(path)
                latencies[name].append(time.perf_counter() - start)
                if response.status_code != 200:
                    errors.append(f"{path}: {response.status_code}")
            except httpx.HTTPError as exc:
                errors.append(f"{path}: {type(exc).__name__}")


async def _load(base_url: str, headers: dict, job_id: str, clients: int, seconds: float):
    latencies: dict[str, list[float]] = {"job": [], "events": [], "metrics": []}
    errors: list[str] = []
    stop_at = time.monotonic() + seconds
    await asyncio.gather(
        *[_client(base_url, headers, job_id, stop_at, latencies, errors) for _ in range(clients)]
    )
    return latencies, errors


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--machine", default="cpu", help="slug for the results file name")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="fusetune-load-"))
    build_tiny_model(root / "data" / "models" / "tiny-llama")
    with running_service(root / "data") as service:
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
        latencies, errors = asyncio.run(
            _load(service.base_url, {"Authorization": f"Bearer {service.api_key}"}, job["id"], args.clients,
                  args.seconds)
        )  # fmt: skip
        status = service.client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"]
        service.client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")

    everything = [x for values in latencies.values() for x in values]
    rows = []
    for name, values in {"all": everything, **latencies}.items():
        rows.append({"route": name, "requests": len(values), "p50_ms": 1000 * statistics.median(values),
                     "p99_ms": 1000 * _percentile(values, 0.99), "max_ms": 1000 * max(values)})  # fmt: skip
    result = {
        "machine": args.machine, "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d"), "clients": args.clients, "seconds": args.seconds,
        "job_status_during_load": status, "errors": len(errors), "error_samples": errors[:10],
        "requests_per_s": len(everything) / args.seconds, "rows": rows,
        "command": f"python benchmarks/load.py --clients {args.clients} --seconds {args.seconds:g}",
    }  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.machine}-load.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# API under load while a job trains ({args.machine}, {os.cpu_count()} cores, {result['date']})", "",
             f"`{result['command']}` — {args.clients} clients for {args.seconds:g} s, "
             f"{result['requests_per_s']:.0f} requests/s, errors: {len(errors)}", "",
             "| route | requests | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['route']} | {r['requests']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} |"
              for r in rows]  # fmt: skip
    (RESULTS / f"{args.machine}-load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
