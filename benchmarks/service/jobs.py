"""The real path, measured: a fine-tuning job through `fusetune serve`'s HTTP API on this machine's GPU.

Starts the embedded service (API, worker, SQLite, the SQLite broker) on a fresh data directory, puts a model of
a public architecture's shape (random weights, the demo tokenizer) in its models directory, uploads a generated
chat file over HTTP and runs one job per variant (kernels on/off, each precision), one after the other. Per
job it records, from the job's own metrics: the median per-step `tokens_per_second` (non-padding input
tokens), `trained_tokens_per_second`, `padding_fraction`, step time and MFU, the peak allocated memory, and
from the client's side: time from job creation to the first reported step, the time from the last step to
the final checkpoint's row (the save), and the checkpoint download's time and size. In the same call it runs
the fusetune row of `benchmarks/step/e2e.py` (bf16 weights and AdamW state, random tokens, no service) for
comparison, so the two are measured on the same machine on the same day.

    python3 -m benchmarks.service.jobs                     # the default variants, results/ files
    python3 -m benchmarks.service.jobs --variants "kernels=on,precision=bf16-mixed;kernels=off"

Results go to the section "jobs" of `benchmarks/results/<gpu-slug>-service.json` (the format of
shared/ANCHORS.md: one row per job, `impl` = "service", plus the e2e row).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import GIB, REPO_ROOT, exit_on_sigterm, format_cell, markdown_table
from benchmarks.step import e2e
from benchmarks.step.memory_plans import write_documents
from benchmarks.workloads import build_model, chat_examples

RESULTS = harness.Benchmark("jobs", topic="service")

MODEL_NAME = "llama-3.2-1b-shape"
DEFAULT_VARIANTS = "kernels=on,precision=auto;kernels=on,precision=bf16-mixed;kernels=off,precision=auto"
TERMINAL = ("succeeded", "failed", "cancelled")


# ------------------------------------------------------------------------------------------- inputs


def parse_variant(text: str) -> dict[str, Any]:
    """`kernels=on,precision=bf16-mixed` -> hyperparameters for the job."""
    hyper: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key == "kernels":
            if value not in ("on", "off"):
                raise ValueError(f"kernels must be on or off, not {value!r}")
            hyper["kernels"] = value == "on"
        elif key == "precision":
            if value != "default":
                hyper["precision"] = value
        elif key == "batch_size":
            hyper["batch_size"] = value if value == "auto" else int(value)
        else:
            raise ValueError(f"unknown variant key {key!r} in {text!r} (kernels, precision, batch_size)")
    return hyper


# ------------------------------------------------------------------------------------------- service


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The server's settings under --final-checkpoint-only: no checkpoint before the job's end.
FINAL_CHECKPOINT_ONLY = {"FUSETUNE_CHECKPOINT_EVERY_MINUTES": "0", "FUSETUNE_CHECKPOINT_EVERY_EPOCH": "false"}


class Service:
    def __init__(self, data_dir: Path, settings: dict[str, str] | None = None) -> None:
        import httpx

        # The server runs in a session of its own: a SIGTERM to this script must reach `close`.
        exit_on_sigterm()

        self.data_dir = data_dir
        self.port = _free_port()
        env = {
            **os.environ,
            "FUSETUNE_DATA_DIR": str(data_dir),
            "FUSETUNE_PORT": str(self.port),
            "FUSETUNE_HOST": "127.0.0.1",
            "FUSETUNE_MAX_UPLOAD_BYTES": str(4 * GIB),
            **(settings or {}),
        }
        self.log = open(data_dir / "server.log", "ab")  # noqa: SIM115 - lives as long as the server
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fusetune.cli", "serve"],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO_ROOT,
        )
        self.client = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            timeout=600,
            headers={"Authorization": "Bearer sk-fusetune-dev"},
        )
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise RuntimeError("the server exited:\n" + self.log_tail())
            try:
                if self.client.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start:\n" + self.log_tail())
            time.sleep(0.5)

    def log_tail(self, n: int = 4000) -> str:
        return (self.data_dir / "server.log").read_text(errors="replace")[-n:]

    def check(self, response) -> dict:
        if response.status_code >= 400:
            raise RuntimeError(f"{response.request.method} {response.request.url.path}: {response.text}")
        return response.json()

    def close(self) -> None:
        self.client.close()
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.log.close()


def all_metrics(service: Service, job_id: str) -> list[dict]:
    points, min_step = [], 0
    while True:
        page = service.check(
            service.client.get(
                f"/v1/fine_tuning/jobs/{job_id}/metrics", params={"min_step": min_step, "limit": 10000}
            )
        )
        points += page["data"]
        if not page.get("has_more") or not page["data"]:
            return points
        min_step = page["data"][-1]["step"] + 1


def run_job(service: Service, model: str, file_id: str, hyper: dict[str, Any], args) -> dict[str, Any]:
    """One job from creation to its downloaded checkpoint; the client-side times come from polling every
    0.2 s, so they are good to about that."""
    body = {
        "model": model,
        "training_file": file_id,
        "seed": 0,
        "hyperparameters": {
            "n_epochs": 1,
            "batch_size": args.batch,
            "max_seq_length": args.seq,
            # --documents: one document per row, cut to the row length (memory_plans.py's rows).
            "packing": not args.documents,
            **hyper,
        },
    }
    created = time.monotonic()
    job = service.check(service.client.post("/v1/fine_tuning/jobs", json=body))
    job_id = job["id"]
    first_step_s = last_step_seen = None
    n_seen = n_printed = 0
    status = timed_out = None
    while True:
        job = service.check(service.client.get(f"/v1/fine_tuning/jobs/{job_id}"))
        page = service.check(
            service.client.get(
                f"/v1/fine_tuning/jobs/{job_id}/metrics", params={"min_step": n_seen + 1, "limit": 10000}
            )
        )
        now = time.monotonic()
        if page["data"]:
            n_seen = page["data"][-1]["step"]
            last_step_seen = now
            if first_step_s is None:
                first_step_s = now - created
        if job["status"] in TERMINAL:
            break
        # Progress on the console, so that a job that runs out of the call's time says how far it got.
        if job["status"] != status or n_seen >= n_printed + 10:
            status, n_printed = job["status"], n_seen
            print(f"  {now - created:.0f} s: {status}, step {n_seen}", flush=True)
        if timed_out is None and now - created > args.job_timeout_s:
            timed_out = n_seen
            service.check(service.client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel"))
        time.sleep(0.2)
    finished = time.monotonic()
    row: dict[str, Any] = {"job_id": job_id, "status": job["status"], "time_to_first_step_s": first_step_s}
    if timed_out is not None:
        # Cancelled at --job-timeout-s: the steps it made are still measured, nothing after them.
        row["error"] = f"cancelled after --job-timeout-s {args.job_timeout_s:g} s at step {timed_out}"
    elif job["status"] != "succeeded":
        row["error"] = json.dumps(job.get("error"))[:400]
        return row
    points = all_metrics(service, job_id)
    if not points:
        return row
    values = [p["values"] for p in points]

    def median(key: str) -> float | None:
        present = [v[key] for v in values if v.get(key) is not None]
        return statistics.median(present) if present else None

    step_s = median("step_time_s")
    row.update(
        steps=len(points),
        tokens_per_s=median("tokens_per_second"),
        trained_tokens_per_s=median("trained_tokens_per_second"),
        padding_fraction=median("padding_fraction"),
        step_time_s=step_s,
        padded_tokens_per_s=args.batch * args.seq / step_s if step_s else None,
        mfu=median("mfu"),
        peak_alloc_gb=max(v.get("peak_memory_allocated_bytes", 0) for v in values) / GIB,
        peak_reserved_gb=max(v.get("peak_memory_reserved_bytes", 0) for v in values) / GIB,
        # From the last step seen to the job's end: the final checkpoint's save and the worker's wrap-up.
        checkpoint_save_s=finished - last_step_seen if last_step_seen else None,
        job_wall_s=finished - created,
    )
    events = service.check(
        service.client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 1000})
    )["data"]
    started = (
        next((e.get("data") for e in events if (e.get("data") or {}).get("event") == "started"), None) or {}
    )
    row["precision_ran"] = started.get("precision")
    row["kernels_ran"] = started.get("kernels")
    row["micro_batch_size"] = started.get("micro_batch_size")
    row["memory_plan"] = started.get("memory_plan_description")
    estimate = started.get("memory_plan_estimate") or {}
    if estimate.get("peak_memory_bytes_per_gpu"):
        row["estimated_peak_gb"] = estimate["peak_memory_bytes_per_gpu"] / GIB
    if args.no_download or timed_out is not None:
        return row
    checkpoints = service.check(service.client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints"))["data"]
    url = f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoints[0]['id']}/content"
    download_started, n_bytes = time.monotonic(), 0
    with service.client.stream("GET", url) as response:
        for chunk in response.iter_bytes(1 << 22):
            n_bytes += len(chunk)
    row["download_s"] = time.monotonic() - download_started
    row["download_gb"] = n_bytes / GIB
    return row


def e2e_row(args, out_dir: Path) -> dict[str, Any]:
    """The fusetune row of e2e.py at the same model and batch, run here and now."""
    command = [
        sys.executable,
        "-m",
        e2e.__spec__.name,
        "--models",
        args.model,
        "--impls",
        args.e2e_impl,
        "--optimizer",
        args.e2e_optimizer,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--out",
        str(out_dir),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=900)
    files = list(out_dir.glob(f"*-{e2e.RESULTS.topic}.json"))
    if completed.returncode != 0 or not files:
        return {"impl": "fusetune", "error": (completed.stdout + completed.stderr)[-600:]}
    rows = harness.read_section(files[0], e2e.RESULTS.name)["rows"]
    return next(r for r in rows if r.get("impl") == args.e2e_impl and r.get("model") == args.model)


# ------------------------------------------------------------------------------------------- main


def render_markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"# Service benchmark — {payload['gpu']}, {payload['date']}",
        "",
        f"`{payload['command']}`; versions: {payload['versions']}",
        "",
        (
            f"Data: {payload['data']['examples']} documents of random words, each cut to one row of "
            f"{payload['seq']} tokens"
            if payload["data"].get("documents")
            else f"Data: {payload['data']['examples']} chat examples, {payload['data']['tokens']:,} tokens (mean "
            f"{payload['data']['mean_tokens']:.0f}), packed into rows of {payload['seq']}"
        )
        + f"; batch {payload['batch']}; model {payload['model']} (random weights, demo tokenizer)."
        + (f" Server settings: {payload['server_settings']}." if payload.get("server_settings") else ""),
        "",
    ]
    header = [
        "run", "status", "precision", "kernels", "tokens/s", "trained tok/s", "padding", "step s",
        "peak GB", "MFU", "first step s", "save s", "download s (GB)",
    ]  # fmt: skip
    rows = []
    for row in payload["rows"]:
        if row.get("impl") == "service":
            # The memory plan that ran (its estimated peak beside it), where the started event gave one.
            plan = (
                f" (plan {row['memory_plan']}, estimated {format_cell(row.get('estimated_peak_gb'))} GB)"
                if row.get("memory_plan")
                else ""
            )
            rows.append([
                row["variant"] + plan, row.get("status"), row.get("precision_ran"), row.get("kernels_ran"),
                row.get("tokens_per_s"), row.get("trained_tokens_per_s"), row.get("padding_fraction"),
                row.get("step_time_s"), row.get("peak_alloc_gb"), row.get("mfu"),
                row.get("time_to_first_step_s"), row.get("checkpoint_save_s"),
                f"{format_cell(row.get('download_s'))} ({format_cell(row.get('download_gb'))})"
                if row.get("download_s") else row.get("error"),
            ])  # fmt: skip
        else:
            rows.append([
                f"e2e.py {row.get('impl')} (bf16 weights, random tokens)", "",
                "fp8" if row.get("impl") in e2e.FLOAT8_IMPLS else "bf16", True,
                row.get("tokens_per_s"), "", 0.0, (row.get("step_ms") or 0) / 1e3, row.get("peak_alloc_gb"),
                row.get("mfu"), "", "", row.get("error", ""),
            ])  # fmt: skip
    lines.append(markdown_table(header, rows))
    goal = payload.get("goal")
    if goal:
        lines += ["", f"Goal check (first variant vs the e2e row): {goal}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Jobs through fusetune serve's HTTP API on this GPU, beside the e2e benchmark's row.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=MODEL_NAME, help="a model shape of benchmarks/workloads.py")
    parser.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help="';'-separated, e.g. kernels=on,precision=bf16"
    )
    parser.add_argument("--examples", type=int, default=1500)
    parser.add_argument("--mean-tokens", type=int, default=620)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--documents",
        action="store_true",
        help="instead of chat examples: --examples documents of random words, each longer than --seq and cut to "
        "it, one per row (the rows of benchmarks/step/memory_plans.py's TRL + Liger-Kernel anchor)",
    )
    parser.add_argument("--no-e2e", action="store_true", help="skip the e2e.py row")
    parser.add_argument(
        "--job-timeout-s",
        type=float,
        default=1800.0,
        help="cancel a job still running after this long; its steps so far are measured",
    )
    parser.add_argument(
        "--no-download", action="store_true", help="skip the final checkpoint's download (an 8B one is 16 GB)"
    )
    parser.add_argument(
        "--final-checkpoint-only",
        action="store_true",
        help="the server checkpoints a job only at its end: an 8B job's checkpoint with 8-bit AdamW state is 32 "
        "GB, and the two kept and the next (the default schedule) do not fit a 64 GB disk",
    )
    parser.add_argument(
        "--e2e-impl",
        default="fusetune",
        choices=e2e.IMPLS,
        help="the e2e.py row's impl (fusetune+fp8: fp8's)",
    )
    parser.add_argument(
        "--e2e-optimizer", default="torch-adamw", choices=e2e.OPTIMIZERS, help="the e2e.py row's optimizer"
    )
    harness.add_results_arguments(parser, RESULTS)
    args = parser.parse_args(argv)
    try:
        args.variant_hyper = [(v.strip(), parse_variant(v)) for v in args.variants.split(";") if v.strip()]
    except ValueError as error:
        parser.error(f"--variants: {error}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from fusetune.demo.assets import build_tokenizer

    if not torch.cuda.is_available():
        print(f"{__spec__.name} measures a GPU service; no CUDA device here", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0)
    data_dir = Path(tempfile.mkdtemp(prefix="fusetune-service-bench-"))
    (data_dir / "models").mkdir(parents=True)
    build_model(data_dir / "models", args.model)
    train_path = data_dir / "train.jsonl"
    if args.documents:
        write_documents(train_path, build_tokenizer(), args.examples, args.seq)
        examples, lengths = [None] * args.examples, [args.seq] * args.examples
    else:
        examples, lengths = chat_examples(
            args.examples, args.mean_tokens, seed=0, tokenizer=build_tokenizer()
        )
        train_path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    print(
        f"{len(examples)} examples, {sum(lengths):,} tokens, mean {statistics.mean(lengths):.0f}", flush=True
    )

    rows: list[dict[str, Any]] = []
    settings = FINAL_CHECKPOINT_ONLY if args.final_checkpoint_only else {}
    service = Service(data_dir, settings)
    try:
        with open(train_path, "rb") as handle:
            uploaded = service.check(
                service.client.post(
                    "/v1/files", files={"file": ("train.jsonl", handle)}, data={"purpose": "fine-tune"}
                )
            )
        for variant, hyper in args.variant_hyper:
            print(f"job {variant} ...", flush=True)
            try:
                row = run_job(service, args.model, uploaded["id"], hyper, args)
            except Exception as error:  # a variant that fails is a row with its error, not a lost run
                row = {"error": f"{type(error).__name__}: {error}"[:600]}
            row = {"model": args.model, "impl": "service", "variant": variant, "batch": args.batch,
                   "seq": args.seq, **row}  # fmt: skip
            rows.append(row)
            print(f"  -> {json.dumps({k: row.get(k) for k in ('status', 'tokens_per_s', 'peak_alloc_gb', 'error')})}",
                  flush=True)  # fmt: skip
    finally:
        service.close()
    if not args.no_e2e:
        print(f"e2e.py {args.e2e_impl} row ...", flush=True)
        reference = e2e_row(args, Path(tempfile.mkdtemp(prefix="fusetune-service-e2e-")))
        rows.append({**reference, "impl": args.e2e_impl, "source": "benchmarks/step/e2e.py"})

    payload: dict[str, Any] = {
        **harness.run_meta(device_name),
        "command": f"python3 -m {__spec__.name} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "data": {
            "examples": len(examples),
            "tokens": sum(lengths),
            "mean_tokens": statistics.mean(lengths),
            **({"documents": True} if args.documents else {}),
        },
        **({"server_settings": settings} if settings else {}),
        "rows": rows,
    }
    service_rows = [r for r in rows if r.get("impl") == "service" and r.get("tokens_per_s")]
    e2e_rows = [r for r in rows if r.get("source") and r.get("tokens_per_s")]
    if service_rows and e2e_rows:
        first, reference = service_rows[0], e2e_rows[0]
        payload["goal"] = (
            f"tokens/s {first['tokens_per_s'] / reference['tokens_per_s']:.3f} x (goal >= 0.95), peak memory "
            f"{first['peak_alloc_gb'] / reference['peak_alloc_gb']:.3f} x (goal <= 1.05)"
        )
    RESULTS.save(args, harness.results_slug(args, device_name), payload, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
