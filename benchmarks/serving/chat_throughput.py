"""Chat completions throughput through the worker's serving server, against the offline ceiling.

The workload (issue 54): --requests streaming chat requests of --new-tokens new tokens each, sent spread evenly
over --arrival-s seconds, to the real serving HTTP server (fusetune/serving/server.py, started in this process on a
free port, its engine holding the benchmark's model) from a client in another process (so the client's threads do
not take the server's interpreter lock). The client records when each request was sent, when its first content
arrived and when it ended; the engine reports each decoding step (Engine.on_step).

    total_tokens_per_s        all new tokens / (last request finished - first request sent)
    ttft_p50_ms, ttft_p95_ms  time to first token: request sent -> first chunk with content
    all_busy_tokens_per_s     decode tokens/s over consecutive steps that ran every slot busy (the steady state;
                              if the first request ends before the last arrives, no step does, and this is over
                              the steps at the most busy slots seen, peak_busy_slots)
    after_arrivals_tokens_per_s   new tokens decoded after the last request was sent / the time from then to the end
    prefills, prefill_ms_*    the engine's prefills (Engine.on_prefill): how many, how many requests each packed,
                              their time from the forward to the first tokens on the host
    arrival_bound_tokens_per_s    what the arrivals allow at best: the last request is sent at --arrival-s and needs
                              --new-tokens steps after its prefill, so the run lasts at least arrival-s + new-tokens
                              x (the all-busy step time)
    ceiling_tokens_per_s      Hugging Face `generate` over all prompts as one left-padded batch, static cache,
                              compiled decoding step (`fusetune` row: the model as serving patched it, apply_fusetune;
                              `hf` row: a fresh unpatched model of the same weights), one untimed call first

Every completion must have exactly --new-tokens tokens: the model has no end-of-turn token (its generation config
names none and the tokenizer is wrapped to name none), and the run fails if a completion's usage says otherwise.
Random weights (seed 0), built on the GPU in bf16; the prompts written by the demo tokenizer's chat template and
the completions decoded by a fast tokenizer of the model's vocabulary (benchmarks/workloads.py, BenchTokenizer).
Sampling at temperature 1 over the whole vocabulary in both (the chat API's default), or --temperature.

    python3 -m benchmarks.serving.chat_throughput --out $OUT        # Llama-3.2-1B shape, 64 x 256, one GPU
    python3 -m benchmarks.serving.chat_throughput --tiny            # 4 requests of 8 tokens on CPU (a smoke run)

Needs, beyond torch, transformers and triton (and what transformers imports): fastapi (with starlette, pydantic,
anyio, annotated-doc, opentelemetry-api), uvicorn (with click, h11) and pydantic-settings (with python-dotenv), all
imported here at the start.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# Everything the run needs, imported before anything is built: a missing package fails in seconds.
import fastapi  # noqa: F401  (the serving server's)
import torch
import transformers
import uvicorn  # noqa: F401  (the serving server's)
from transformers import GenerationConfig

import fusetune.models  # noqa: F401  (the kernels the engine patches the model with on a GPU)
import fusetune.serving.engine  # noqa: F401  (imported by the server at its first request otherwise)
from benchmarks import harness
from benchmarks.harness import markdown_table
from benchmarks.workloads import MODEL_SHAPES, BenchTokenizer, serving_model
from fusetune.config import Settings
from fusetune.serving.engine import patch_for_decoding
from fusetune.serving.server import ServingServer
from fusetune.spec.chat import TENANT_HEADER

RESULTS = harness.Benchmark("chat-throughput", topic="service")
MODEL_NAME = "bench-model"


class _OneModel:
    """The model locations the server asks: every name is the benchmark's model."""

    def location_of(self, model: str, tenant: str) -> str:
        return MODEL_NAME

    def adapter_base_models(self, tenant: str, location: str) -> dict[str, str]:
        return {}


def _prompts(count: int) -> list[list[dict[str, str]]]:
    """Distinct short chat prompts (about 40 to 60 tokens with the template)."""
    topics = ["the weather", "a sum of two numbers", "a short poem", "the next prime", "a list of colours"]
    return [
        [
            {
                "role": "user",
                "content": f"Request {i}: tell me about {topics[i % len(topics)]}, {i * 37 % 1000} ways.",
            }
        ]
        for i in range(count)
    ]


# ---------------------------------------------------------------------------------------------------- client


def _client(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Send the requests on their schedule, one thread each; what each saw, times from time.perf_counter()
    (CLOCK_MONOTONIC, the server process's clock too)."""
    start = time.perf_counter() + 0.2
    results: list[dict[str, Any]] = [{} for _ in spec["messages"]]

    def one(index: int) -> None:
        record = results[index]
        body = {
            "model": MODEL_NAME, "messages": spec["messages"][index], "stream": True,
            "max_completion_tokens": spec["new_tokens"], "temperature": spec["temperature"],
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        delay = start + spec["offsets"][index] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        connection = http.client.HTTPConnection(spec["host"], spec["port"], timeout=600)
        record["sent"] = time.perf_counter()
        connection.request(
            "POST", "/v1/chat/completions", body=json.dumps(body),
            headers={"Authorization": f"Bearer {spec['token']}", TENANT_HEADER: "bench",
                     "Content-Type": "application/json"},
        )  # fmt: skip
        response = connection.getresponse()
        if response.status != 200:
            record["error"] = f"HTTP {response.status}: {response.read()[:300]!r}"
            return
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                record["error"] = chunk["error"]["message"]
                break
            if chunk.get("usage"):
                record["completion_tokens"] = chunk["usage"]["completion_tokens"]
            if "first" not in record and any(c["delta"].get("content") for c in chunk["choices"]):
                record["first"] = time.perf_counter()
        record["end"] = time.perf_counter()
        connection.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(spec["messages"]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def run_clients(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The client in a process of its own; its results come back on its stdout."""
    completed = subprocess.run(
        [sys.executable, "-m", __spec__.name, "--_client", json.dumps(spec)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    if completed.returncode != 0:
        raise RuntimeError(f"the client failed: {completed.stderr[-2000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------- serving


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def measure_serving(args: argparse.Namespace, model: Any, tokenizer: BenchTokenizer) -> dict[str, Any]:
    settings = Settings(
        serving_host="127.0.0.1", serving_port=0, serving_max_batch=args.requests, serving_max_len=args.max_len,
        serving_idle_s=3600,
    )  # fmt: skip
    server = ServingServer(settings, _OneModel())  # type: ignore[arg-type]
    # The server loads "models" through its engine: this one is already built.
    server.engine.load_model = lambda location, bases: (model, tokenizer)  # type: ignore[method-assign]
    server.start()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    base = {"host": host, "port": int(port), "token": server.token, "temperature": args.temperature}
    try:
        # Warm-up: the model is patched and the decoding step compiled (and its CUDA graphs recorded) at the first
        # requests; two rounds of a few requests, then the timed run.
        started = time.perf_counter()
        for _ in range(2):
            warm = run_clients({**base, "messages": _prompts(4), "offsets": [0.0] * 4, "new_tokens": 8})
            _check(warm, 8)
        warmup_s = time.perf_counter() - started
        steps: list[tuple[int, float]] = []
        prefills: list[tuple[int, int, float]] = []
        engine = server.engine.get()
        engine.on_step = lambda key, busy, at: steps.append((busy, at))
        engine.on_prefill = lambda key, requests, tokens, seconds: prefills.append(
            (requests, tokens, seconds)
        )
        offsets = [args.arrival_s * i / max(1, args.requests - 1) for i in range(args.requests)]
        spec = {
            **base,
            "messages": _prompts(args.requests),
            "offsets": offsets,
            "new_tokens": args.new_tokens,
        }
        records = run_clients(spec)
        engine.on_step = engine.on_prefill = None
    finally:
        server.stop()
    _check(records, args.new_tokens)
    first_sent = min(r["sent"] for r in records)
    last_sent = max(r["sent"] for r in records)
    last_end = max(r["end"] for r in records)
    new_tokens = sum(r["completion_tokens"] for r in records)
    ttft_ms = [1e3 * (r["first"] - r["sent"]) for r in records]
    peak = max(busy for busy, _ in steps)
    # The time from one step's tokens to the next's, where both ran the peak's rows: a prefill between two steps
    # (a request joining) is not in it.
    gaps = [
        at - before_at
        for (before, before_at), (busy, at) in zip(steps, steps[1:], strict=False)
        if before == busy == peak
    ]
    step_ms = 1e3 * statistics.mean(gaps) if gaps else None
    all_busy = round(peak * 1e3 / step_ms) if step_ms else None
    after = sum(busy for busy, at in steps if at > last_sent)
    row: dict[str, Any] = {
        "requests": args.requests, "new_tokens": args.new_tokens, "arrival_s": args.arrival_s,
        "slots": args.requests, "max_len": args.max_len, "warmup_s": round(warmup_s, 1),
        "seconds": round(last_end - first_sent, 3),
        "total_tokens_per_s": round(new_tokens / (last_end - first_sent)),
        "ttft_p50_ms": round(statistics.median(ttft_ms), 1),
        "ttft_p95_ms": round(_percentile(ttft_ms, 0.95), 1),
        "ttft_max_ms": round(max(ttft_ms), 1),
        "decode_steps": len(steps),
        "peak_busy_slots": peak,
        "all_busy_steps": len(gaps),
        "all_busy_step_ms": round(step_ms, 2) if step_ms else None,
        "all_busy_tokens_per_s": all_busy,
        "after_arrivals_s": round(last_end - last_sent, 3),
        "after_arrivals_tokens_per_s": round(after / (last_end - last_sent)),
        "prefills": len(prefills),
        "prefill_requests_mean": round(statistics.mean(r for r, _, _ in prefills), 2),
        "prefill_ms_mean": round(1e3 * statistics.mean(t for _, _, t in prefills), 2),
        "prefill_ms_max": round(1e3 * max(t for _, _, t in prefills), 2),
        "prefill_ms_first": [round(1e3 * t, 1) for _, _, t in prefills[:3]],
    }  # fmt: skip
    if step_ms:
        bound_s = (last_sent - first_sent) + args.new_tokens * step_ms / 1e3
        row["arrival_bound_s"] = round(bound_s, 3)
        row["arrival_bound_tokens_per_s"] = round(new_tokens / bound_s)
    return row


def _check(records: list[dict[str, Any]], new_tokens: int) -> None:
    for index, record in enumerate(records):
        if "error" in record:
            raise RuntimeError(f"request {index}: {record['error']}")
        if record.get("completion_tokens") != new_tokens:
            raise RuntimeError(
                f"request {index}: completion_tokens {record.get('completion_tokens')}, expected {new_tokens}"
            )
        if "first" not in record:
            raise RuntimeError(f"request {index}: no content streamed")


# ---------------------------------------------------------------------------------------------------- ceiling


def run_ceiling(args: argparse.Namespace, which: str) -> dict[str, Any]:
    """measure_ceiling in a child process: `fusetune`, the model patched as serving patches it; `hf`, unpatched."""
    argv = ["--model", args.model, "--requests", str(args.requests), "--new-tokens", str(args.new_tokens),
            "--temperature", str(args.temperature), *(["--tiny"] if args.tiny else [])]  # fmt: skip
    completed = subprocess.run(
        [sys.executable, "-m", __spec__.name, *argv, "--_ceiling", which],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    if completed.returncode != 0:
        raise RuntimeError(f"the {which} ceiling failed: {completed.stderr[-2000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _ceiling_process(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = serving_model(args.model, device, args.tiny)
    if args._ceiling == "fusetune":
        patch_for_decoding(model)  # what the engine does to a model it loads
    return measure_ceiling(args, model, tokenizer, device)


def measure_ceiling(
    args: argparse.Namespace, model: Any, tokenizer: BenchTokenizer, device: torch.device
) -> dict:
    """`generate` over all prompts as one batch: static cache, decoding step compiled (on a GPU)."""
    ids = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        for m in _prompts(args.requests)
    ]
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[0] * (width - len(i)) + list(i) for i in ids], device=device)
    attention_mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
    options = dict(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, use_cache=True, pad_token_id=0,
        eos_token_id=None, cache_implementation="static", disable_compile=device.type != "cuda",
    )  # fmt: skip
    if args.temperature == 0:
        options.update(do_sample=False)
    else:
        options.update(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)

    def generate() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=GenerationConfig(**options),
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert output.shape == (args.requests, width + args.new_tokens), output.shape
        return time.perf_counter() - start

    first_s = generate()
    timed_s = generate()
    return {
        "first_s": round(first_s, 2), "seconds": round(timed_s, 3),
        "tokens_per_s": round(args.requests * args.new_tokens / timed_s),
        "step_ms": round(1e3 * timed_s / args.new_tokens, 2),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------- report


def render_markdown(payload: dict[str, Any]) -> str:
    row = payload["serving"]
    lines = [
        f"### Chat completions throughput ({payload.get('gpu', '?')}, {payload.get('date', '?')})",
        "",
        f"{row.get('requests')} streaming requests x {row.get('new_tokens')} new tokens, sent over "
        f"{row.get('arrival_s')} s, {payload['model']}; {row.get('slots')} slots of {row.get('max_len')} columns",
        "",
    ]
    table = [
        ["serving: total", row.get("total_tokens_per_s"), row.get("seconds"), ""],
        ["serving: after the last arrival", row.get("after_arrivals_tokens_per_s"), row.get("after_arrivals_s"), ""],
        ["serving: all slots busy", row.get("all_busy_tokens_per_s"), None, row.get("all_busy_step_ms")],
        ["arrival bound (arrivals + new_tokens busy steps)", row.get("arrival_bound_tokens_per_s"),
         row.get("arrival_bound_s"), ""],
    ]  # fmt: skip
    for name, ceiling in payload["ceilings"].items():
        table.append(
            [f"ceiling: generate, static, compiled ({name})", ceiling.get("tokens_per_s"), ceiling.get("seconds"),
             ceiling.get("step_ms")]
        )  # fmt: skip
    lines.append(markdown_table(["what", "new tokens/s", "seconds", "ms per step"], table))
    if "ttft_p50_ms" in row:
        lines += ["", f"time to first token: p50 {row['ttft_p50_ms']} ms, p95 {row['ttft_p95_ms']} ms, "
                  f"max {row['ttft_max_ms']} ms"]  # fmt: skip
    if "prefills" in row:
        lines.append(f"prefills: {row['prefills']}, {row['prefill_requests_mean']} requests each on average, "
                     f"{row['prefill_ms_mean']} ms mean, {row['prefill_ms_max']} ms max (the first: "
                     f"{row['prefill_ms_first']})")  # fmt: skip
    for name, ceiling in payload["ceilings"].items():
        if row.get("total_tokens_per_s") and ceiling.get("tokens_per_s"):
            ratio = row["total_tokens_per_s"] / ceiling["tokens_per_s"]
            lines.append(f"serving total / ceiling ({name}): {ratio:.2f}")
    lines += [f"error: {error}" for error in payload.get("errors", [])]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_results_arguments(parser, RESULTS)
    parser.add_argument("--model", default="llama-3.2-1b-shape", help=f"one of {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--requests", type=int, default=None, help="default 64 (--tiny: 4); also the slots")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (--tiny: 8)")
    parser.add_argument("--arrival-s", type=float, default=None, help="default 2 (--tiny: 0.2)")
    parser.add_argument("--max-len", type=int, default=512, help="each slot's cache columns")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--no-hf-ceiling", action="store_true", help="skip the unpatched model's ceiling")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (a smoke run)")
    parser.add_argument("--_client", help=argparse.SUPPRESS)
    parser.add_argument("--_ceiling", choices=("fusetune", "hf"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._client:
        print(json.dumps(_client(json.loads(args._client))))
        return 0
    if args._ceiling:
        print(json.dumps(_ceiling_process(args)))
        return 0
    defaults = (4, 8, 0.2) if args.tiny else (64, 256, 2.0)
    args.requests = args.requests or defaults[0]
    args.new_tokens = args.new_tokens or defaults[1]
    args.arrival_s = defaults[2] if args.arrival_s is None else args.arrival_s
    if args.out == harness.RESULTS_DIR and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        print(f"{__spec__.name} measures serving on a GPU; no CUDA device here (--tiny runs on CPU)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.tiny:
        harness.smoke_out(args, "chat-throughput-")
    device_name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    errors: list[str] = []

    def measured(what: str, measure: Any) -> dict[str, Any]:
        # A part that fails is written as its error; the parts measured still are.
        try:
            return measure()
        except Exception as exc:
            traceback.print_exc()
            errors.append(f"{what}: {harness.short_error(exc)}")
            return {"error": harness.short_error(exc)}

    # Each ceiling in a process of its own: CUDA graph trees keep their state per thread, and a `generate` in
    # this thread after the engine's thread had captured the same model's graphs failed on the H200 (an
    # AssertionError in cudagraph_trees.get_obj), so the serving run's process never compiles anything else.
    ceilings = {"fusetune": measured("fusetune ceiling", lambda: run_ceiling(args, "fusetune"))}
    if not args.no_hf_ceiling:
        ceilings["hf"] = measured("hf ceiling", lambda: run_ceiling(args, "hf"))
    model, tokenizer = serving_model(args.model, device, args.tiny)
    serving = measured("serving", lambda: measure_serving(args, model, tokenizer))
    payload = {
        **harness.run_meta(device_name), "model": args.model, "tiny": args.tiny,
        "transformers": transformers.__version__, "serving": serving, "ceilings": ceilings, "errors": errors,
    }  # fmt: skip
    RESULTS.save(
        args, harness.results_slug(args, device_name, on_gpu=device.type == "cuda"), payload, render_markdown
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
