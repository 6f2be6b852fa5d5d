"""Which causal-LM families of the installed transformers fusetune patches without a table row.

    python -m benchmarks.models.families_share                      # every model_type, about 10 minutes
    python -m benchmarks.models.families_share --model-types olmo2,gpt2 --out /tmp/share

For every model_type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING: a miniature of its default config
(`fusetune.models.miniature`: hidden 64, two layers, random weights, float32, on the CPU with the kernels
under TRITON_INTERPRET=1) goes through the recognizer (`fusetune.models.recognize`), families with a row in
the table too (they show that recognition finds what the hand-written row says). Each family is
"recognised" (every part found and proven by its probe), "partly" (some parts left, each with the reason),
"not" (nothing found) or "no miniature" (transformers could not build one from the default config). Writes the
section "share" of benchmarks/results/cpu-families.json.

The model types run in worker processes of --chunk types each, each type under a --type-timeout-s alarm; a
worker that dies costs the type it was on, which becomes an error row, and the rest go to a new worker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import markdown_table, short_error

RESULTS = harness.Benchmark("share", topic="families")
SHARES = ("recognised", "partly", "not", "no miniature")
METHOD = (
    "miniature of each model_type's default config (fusetune.models.miniature.shrink_config: hidden 64, two "
    "layers, vocabulary 256, random weights, float32), built by AutoModelForCausalLM.from_config with "
    "transformers' default attention, recognised by fusetune.models.recognize.recognize on the CPU with the "
    "Triton kernels under TRITON_INTERPRET=1; every part found is proven by its probe (forward and backward "
    "within fusetune/models/probe.py's PROBE_TOLERANCES) before it counts; a miniature that transformers "
    "cannot build, or whose own forward fails on 6 tokens, is 'no miniature'"
)


def all_model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# ---------------------------------------------------------------------------------------------------------
# Worker: a list of model types in this process.


def recognise_one(model_type: str) -> dict[str, Any]:
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from fusetune.models import FAMILIES
    from fusetune.models.miniature import build_miniature
    from fusetune.models.recognize import recognize

    row: dict[str, Any] = {
        "model_type": model_type,
        "causal_lm_class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type),
        "table_row": model_type in FAMILIES,
    }
    started = time.perf_counter()
    try:
        model = build_miniature(model_type)
        with torch.no_grad():  # a miniature whose own forward fails says nothing about the recognizer
            model(input_ids=torch.randint(3, 200, (1, 6)), use_cache=False)
    except Exception as error:  # noqa: BLE001 - a family transformers cannot build small is a row
        return {**row, "share": "no miniature", "error": short_error(error, 240)}
    row["parameters"] = sum(p.numel() for p in model.parameters())
    recognition = recognize(model)
    row["seconds"] = round(time.perf_counter() - started, 2)
    return {**row, "share": recognition.share, "found": recognition.found, "left": recognition.left}


def _alarm(_signum: int, _frame: Any) -> None:
    raise TimeoutError("ran past the per-type time limit")


def worker(model_types: list[str], timeout_s: int) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    signal.signal(signal.SIGALRM, _alarm)
    for model_type in model_types:
        # The alarm stops Python code; a call stuck in native code is ended by the watchdog, which exits the
        # process (the parent records the type as an error and goes on with a new worker).
        watchdog = threading.Timer(timeout_s + 30, os._exit, args=(3,))
        watchdog.daemon = True
        watchdog.start()
        signal.alarm(timeout_s)
        try:
            row = recognise_one(model_type)
        except Exception as error:  # noqa: BLE001 - recorded as the type's error
            row = {"model_type": model_type, "share": "error", "error": short_error(error, 240)}
        finally:
            signal.alarm(0)
            watchdog.cancel()
        harness.report(row)
    return 0


# ---------------------------------------------------------------------------------------------------------
# Parent.


def run(model_types: list[str], chunk: int, timeout_s: int) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    pending = list(model_types)
    while pending:
        batch = pending[:chunk]
        started = time.perf_counter()
        worker_run = harness.run_worker(
            __spec__.name,
            ["--worker", json.dumps(batch), "--type-timeout-s", str(timeout_s)],
            timeout_s * len(batch) + 120,
            cpu=True,
        )
        for row in worker_run.results:
            rows[row["model_type"]] = row
        done = [t for t in batch if t in rows]
        left = [t for t in batch if t not in rows]
        if left:  # the worker died on the first type it did not report
            rows[left[0]] = {
                "model_type": left[0],
                "share": "error",
                "error": f"ran past {timeout_s} s or ended its process ({worker_run.failure or 'stopped'})"[
                    :300
                ],
            }
            left = left[1:]
        print(
            f"{len(rows)}/{len(model_types)} types, {len(done)} in {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        pending = left + pending[chunk:]
    return [rows[t] for t in model_types]


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts = Counter(row["share"] for row in rows)
    structure = [row for row in rows if not row.get("table_row")]
    return {
        "counts": {share: counts.get(share, 0) for share in (*SHARES, "error")},
        "counts_without_a_table_row": {
            share: sum(row["share"] == share for row in structure) for share in (*SHARES, "error")
        },
        "parts_left": dict(
            Counter(part.split(" ")[0] for row in rows for part in row.get("left", {})).most_common()
        ),
    }


def headlines(payload: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """SUMMARY.md's row: the share of families without a table row that are patched by structure."""
    without = payload["counts_without_a_table_row"]
    return [
        (
            "causal-LM families without a table row, patched by structure",
            f"{sum(without.values())} model_types of transformers {payload['versions'].get('transformers')}",
            f"{without['recognised']} recognised, {without['partly']} partly",
            f"{without['not']} not, {without['no miniature'] + without['error']} not built",
        )
    ]


def render_markdown(payload: dict[str, Any]) -> str:
    versions = payload.get("versions", {})
    counts, without = payload["counts"], payload["counts_without_a_table_row"]
    total = sum(counts.values())
    lines = [
        f"# Families recognised by structure ({payload['machine']}, {payload['date']})",
        "",
        f"Versions: transformers {versions.get('transformers')}, torch {versions.get('torch')}, "
        f"fusetune {versions.get('fusetune')}.",
        "",
        f"Method: {payload['method']}.",
        "",
        markdown_table(
            ["", *SHARES, "error", "all"],
            [
                ["every model_type", *(counts[s] for s in (*SHARES, "error")), total],
                [
                    "without a table row",
                    *(without[s] for s in (*SHARES, "error")),
                    sum(without.values()),
                ],
            ],
        ),
        "",
        "Parts left, by kind (a family may leave several): "
        + ", ".join(f"{kind} {n}" for kind, n in payload["parts_left"].items())
        + ".",
        "",
    ]
    table = []
    for row in payload["rows"]:
        found = ", ".join(part for part in row.get("found", {}))
        left = "; ".join(f"{part}: {why}" for part, why in row.get("left", {}).items())
        share = row["share"] + (" (table row)" if row.get("table_row") else "")
        table.append([row["model_type"], share, found or "–", left or row.get("error", "") or "–"])
    lines += [markdown_table(["model_type", "share", "found and proven", "left, and why"], table)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-types", default="", help="comma-separated; default: every causal-LM type")
    parser.add_argument("--chunk", type=int, default=16, help="model types per worker process")
    parser.add_argument("--type-timeout-s", type=int, default=120, help="limit for one model type")
    parser.add_argument("--machine", default="cpu", help="slug of the results file name")
    parser.add_argument("--out", type=Path, default=harness.RESULTS_DIR, help="folder of the results file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker), args.type_timeout_s)

    model_types = harness.comma_list(args.model_types) if args.model_types else all_model_types()
    rows = run(model_types, args.chunk, args.type_timeout_s)
    payload = {
        **harness.run_meta(args.machine),
        "machine": args.machine,
        "method": METHOD,
        **summarise(rows),
        "rows": rows,
    }
    print(render_markdown(payload))
    print(f"wrote {RESULTS.write(args.out, args.machine, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
