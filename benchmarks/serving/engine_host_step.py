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

    python3 -m benchmarks.serving.engine_host_step                       # 64 slots x 256 tokens, temperature 1
    python3 -m benchmarks.serving.engine_host_step --top-p 0.9
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

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


def measure(args: argparse.Namespace) -> dict[str, float]:
    demo = build_tokenizer()
    size, specials = len(demo), set(demo.all_special_ids)
    vocab = max(args.vocab, size)
    # The demo tokenizer itself at its own vocabulary (what a real model's fast tokenizer is); folded beyond it.
    tokenizer = demo if vocab == size else _FoldedTokenizer(demo)
    banned = {i for i in range(vocab) if i % size in specials}  # no end of turn, no text-less special token
    model = TableModel(vocab, banned, args.max_len)
    engine = Engine(idle_s=600, max_batch=args.requests, device=torch.device("cpu"), max_len=args.max_len)

    spent = {"model": 0.0, "sampling": 0.0, "take": 0.0}
    step, launch, take = SlotBatch.step, Engine._launch, Engine._take

    def timed_step(self: SlotBatch) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return step(self)
        finally:
            spent["model"] += time.perf_counter() - start

    def timed_launch(self: Engine, slots: SlotBatch) -> Any:
        start, model_before = time.perf_counter(), spent["model"]
        try:
            return launch(self, slots)
        finally:
            spent["sampling"] += time.perf_counter() - start - (spent["model"] - model_before)

    def timed_take(self: Engine, sequence: Any, token: int) -> None:
        start = time.perf_counter()
        try:
            take(self, sequence, token)
        finally:
            spent["take"] += time.perf_counter() - start

    SlotBatch.step, Engine._launch, Engine._take = timed_step, timed_launch, timed_take
    marks: list[tuple[int, float, dict[str, float]]] = []
    engine.on_step = lambda key, busy, at: marks.append((busy, at, dict(spent)))

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    done = [threading.Event() for _ in range(args.requests)]

    def emitter(i: int) -> Any:
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)  # what the serving server's emit does
            if event[0] in ("usage", "error"):
                done[i].set()

        return emit

    try:
        with engine._lock:  # all admitted in one pass: every step after the first runs every slot busy
            for i in range(args.requests):
                body = ChatCompletionCreate(
                    model="table", messages=[{"role": "user", "content": f"Request {i}: say something."}],
                    max_completion_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                    seed=i,
                )  # fmt: skip
                engine.submit("table", lambda: (model, tokenizer), body, emitter(i))
        for event in done:
            assert event.wait(600), "a request did not finish"
    finally:
        engine.stop()
        SlotBatch.step, Engine._launch, Engine._take = step, launch, take
        loop.call_soon_threadsafe(loop.stop)

    busy = [(at, counters) for slots_busy, at, counters in marks if slots_busy == args.requests]
    gaps = {name: [] for name in ("step", "model", "sampling", "take")}
    for (at0, c0), (at1, c1) in zip(busy, busy[1:], strict=False):
        gaps["step"].append(at1 - at0)
        for name in ("model", "sampling", "take"):
            gaps[name].append(c1[name] - c0[name])
    # Means, so the parts add up to the step (the rest is the difference).
    result = {name: 1000 * statistics.fmean(values) for name, values in gaps.items()}
    result["rest"] = result["step"] - result["model"] - result["sampling"] - result["take"]
    result["all_busy_steps"] = len(gaps["step"])
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args)
    print(
        f"{args.requests} slots x {args.new_tokens} tokens, temperature {args.temperature}, top_p {args.top_p}, "
        f"vocab {args.vocab}: mean over {result['all_busy_steps']} all-busy steps, ms per step"
    )
    print(
        "  "
        + "  ".join(f"{name} {result[name]:.2f}" for name in ("step", "model", "sampling", "take", "rest"))
    )


if __name__ == "__main__":
    main()
