"""The serving engine's host work per decoding step, apart from the model's.

The engine (fusetune/serving/engine.py) drives a model whose forward costs next to nothing: its logits are a row of
a fixed random table picked by the input token, so a step's time is the engine's own work. --requests chats, all
admitted in one pass (submitted under the engine's lock), each of --new-tokens tokens at --temperature / --top-p
and its own seed, fill as many slots; the events go, as the serving server's do, through an asyncio loop's
call_soon_threadsafe to a queue per request (fusetune/serving/server.py). Over the steps that ran every slot busy,
the mean time between two steps (Engine.on_step) is split into:

    model      SlotBatch.step (the trivial forward, and the step's mask and position updates)
    sampling   the rest of Engine._launch: the tokens of every row drawn from the step's logits
    take       Engine._take of every live row: detokenize, look for stops and end of turn, emit the events
    rest       the scheduler's loop, admission checks and the read of the step's tokens

The model never gives an end-of-turn token (the table's column for it is -inf), so every completion runs its
length. The tokenizer is the demo's (byte-level BPE, 512 tokens; --vocab folds a larger vocabulary onto it, through
a wrapper whose decode is transformers' rather than the fast tokenizer's own).

With --model (a shape of benchmarks/workloads.py) the engine runs that model instead, random weights in bf16 on a
GPU, patched and its step compiled as serving does (after an untimed round of 4-token requests that compiles it),
and each launch is also timed on the device by CUDA events:

    device_step       SlotBatch.step on the device (the one-shape step, replayed as CUDA graphs)
    device_sampling   the sampling kernels after it

so a step whose time is the device's shows `rest` (the wait for the step's tokens) near device_step +
device_sampling, and one whose time is the host's shows them far below `step`. It also prints what dynamo counted:
graphs compiled, graph breaks, and CUDA graphs skipped.

    python3 -m benchmarks.serving.engine_host_step                       # 64 slots x 256 tokens, temperature 1
    python3 -m benchmarks.serving.engine_host_step --top-p 0.9
    python3 -m benchmarks.serving.engine_host_step --model llama-3.2-1b-shape --json $OUT/host-step.json   # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.workloads import serving_model
from fusetune.demo.assets import build_tokenizer
from fusetune.serving.engine import Engine
from fusetune.serving.slots import SlotBatch
from fusetune.spec.chat import ChatCompletionCreate


class TableModel(torch.nn.Module):
    """Logits = a fixed random row per input token; the prefill's keys and values are one small layer of zeros."""

    def __init__(self, vocab: int, banned: set[int], context: int, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        table = torch.randn(vocab, vocab, generator=generator) * 3
        table[:, sorted(banned)] = float("-inf")
        self.table = torch.nn.Parameter(table, requires_grad=False)
        self.config = SimpleNamespace(max_position_embeddings=context)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        logits = self.table[input_ids]
        layer = SimpleNamespace(
            keys=torch.zeros(1, 1, input_ids.shape[1], 8), values=torch.zeros(1, 1, input_ids.shape[1], 8)
        )
        return SimpleNamespace(logits=logits, past_key_values=SimpleNamespace(layers=[layer]))


class _FoldedTokenizer:
    """The demo tokenizer; a vocabulary larger than its own is folded onto its ids."""

    eos_token_id = None

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._size = len(tokenizer)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self._tokenizer.decode([i % self._size for i in ids], **kwargs)


def _table_model(args: argparse.Namespace) -> tuple[Any, Any]:
    demo = build_tokenizer()
    size, specials = len(demo), set(demo.all_special_ids)
    vocab = max(args.vocab, size)
    # The demo tokenizer itself at its own vocabulary (what a real model's fast tokenizer is); folded beyond it.
    tokenizer = demo if vocab == size else _FoldedTokenizer(demo)
    banned = {i for i in range(vocab) if i % size in specials}  # no end of turn, no text-less special token
    return TableModel(vocab, banned, args.max_len), tokenizer


def _run(
    engine: Engine, model: Any, tokenizer: Any, args: argparse.Namespace, requests: int, tokens: int
) -> None:
    """`requests` chats of `tokens` tokens, all admitted in one pass: every step after the first runs them all."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    done = [threading.Event() for _ in range(requests)]

    def emitter(i: int) -> Any:
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)  # what the serving server's emit does
            if event[0] in ("usage", "error"):
                done[i].set()

        return emit

    try:
        with engine._lock:  # all admitted in one pass: every step after the first runs every slot busy
            for i in range(requests):
                body = ChatCompletionCreate(
                    model="bench", messages=[{"role": "user", "content": f"Request {i}: say something."}],
                    max_completion_tokens=tokens, temperature=args.temperature, top_p=args.top_p, seed=i,
                )  # fmt: skip
                engine.submit("bench", lambda: (model, tokenizer), body, emitter(i))
        for event in done:
            assert event.wait(900), "a request did not finish"
    finally:
        loop.call_soon_threadsafe(loop.stop)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    on_gpu = args.model is not None
    model, tokenizer = serving_model(args.model, "cuda") if on_gpu else _table_model(args)
    device = torch.device("cuda" if on_gpu else "cpu")
    engine = Engine(idle_s=600, max_batch=args.requests, device=device, max_len=args.max_len)
    if on_gpu:  # the step compiled and its CUDA graphs recorded, before anything is timed
        _run(engine, model, tokenizer, args, args.requests, 4)

    spent = {"model": 0.0, "sampling": 0.0, "take": 0.0}
    # On a GPU, CUDA events around each launch: (start, the step's end, the sampling's end) on the device.
    launches: list[tuple[Any, Any, Any]] = []
    step_ends: list[Any] = []
    step, launch, take = SlotBatch.step, Engine._launch, Engine._take

    def event() -> Any:
        recorded = torch.cuda.Event(enable_timing=True)
        recorded.record()
        return recorded

    def timed_step(self: SlotBatch) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return step(self)
        finally:
            spent["model"] += time.perf_counter() - start
            if on_gpu:
                step_ends.append(event())

    def timed_launch(self: Engine, slots: SlotBatch) -> Any:
        start, model_before = time.perf_counter(), spent["model"]
        began = event() if on_gpu else None
        try:
            return launch(self, slots)
        finally:
            spent["sampling"] += time.perf_counter() - start - (spent["model"] - model_before)
            if on_gpu:
                launches.append((began, step_ends[-1], event()))

    def timed_take(self: Engine, sequence: Any, token: int) -> None:
        start = time.perf_counter()
        try:
            take(self, sequence, token)
        finally:
            spent["take"] += time.perf_counter() - start

    SlotBatch.step, Engine._launch, Engine._take = timed_step, timed_launch, timed_take
    marks: list[tuple[int, float, dict[str, float], int]] = []
    engine.on_step = lambda key, busy, at: marks.append((busy, at, dict(spent), len(launches)))
    try:
        _run(engine, model, tokenizer, args, args.requests, args.new_tokens)
    finally:
        engine.stop()
        SlotBatch.step, Engine._launch, Engine._take = step, launch, take

    busy = [(at, counters, n) for slots_busy, at, counters, n in marks if slots_busy == args.requests]
    gaps: dict[str, list[float]] = {name: [] for name in ("step", "model", "sampling", "take")}
    device_step, device_sampling = [], []
    for (at0, c0, n0), (at1, c1, n1) in zip(busy, busy[1:], strict=False):
        gaps["step"].append(at1 - at0)
        for name in ("model", "sampling", "take"):
            gaps[name].append(c1[name] - c0[name])
        if on_gpu and n1 == n0 + 1:  # one launch between the two marks: that step's device times
            began, stepped, ended = launches[n1 - 1]
            ended.synchronize()
            device_step.append(began.elapsed_time(stepped) / 1e3)
            device_sampling.append(stepped.elapsed_time(ended) / 1e3)
    # Means, so the parts add up to the step (the rest is the difference).
    result: dict[str, Any] = {name: 1000 * statistics.fmean(values) for name, values in gaps.items()}
    result["rest"] = result["step"] - result["model"] - result["sampling"] - result["take"]
    result["all_busy_steps"] = len(gaps["step"])
    if on_gpu:
        from torch._dynamo.utils import counters

        result["device_step"] = 1000 * statistics.fmean(device_step)
        result["device_sampling"] = 1000 * statistics.fmean(device_sampling)
        result["graphs_compiled"] = counters["stats"]["unique_graphs"]
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["cudagraph_skips"] = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64, help="also the slots")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--vocab", type=int, default=512, help="the model's vocabulary (at least the tokenizer's)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch's CPU threads (the host's work is serial)"
    )
    parser.add_argument(
        "--model", default=None,
        help="a shape of benchmarks/workloads.py (llama-3.2-1b-shape): the real model on the GPU, instead of the table",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args)
    what = args.model or f"vocab {args.vocab}"
    print(
        f"{args.requests} slots x {args.new_tokens} tokens, temperature {args.temperature}, top_p {args.top_p}, "
        f"{what}: mean over {result['all_busy_steps']} all-busy steps, ms per step"
    )
    parts = ("step", "model", "sampling", "take", "rest", "device_step", "device_sampling")
    print("  " + "  ".join(f"{name} {result[name]:.2f}" for name in parts if name in result))
    if args.model:
        print(f"  graphs compiled {result['graphs_compiled']}, graph breaks {result['graph_breaks']}, "
              f"CUDA graph counters {result['cudagraph_skips']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, **result}, indent=1))


if __name__ == "__main__":
    main()
