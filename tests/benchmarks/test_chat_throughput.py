"""benchmarks/serving/chat_throughput.py runs end to end on CPU at a tiny shape (--tiny): the serving server with the
benchmark's model, its streaming client in another process, every completion checked to have its token count, and
the offline ceiling. Nothing here is timed: the test reads what the run wrote, not how fast it was."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_tiny_run_serves_every_request_to_its_length_and_writes_its_section(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving.chat_throughput", "--tiny", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=REPO_ROOT,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    section = json.loads((tmp_path / "cpu-service.json").read_text())["sections"]["chat-throughput"]
    serving = section["serving"]
    assert (serving["requests"], serving["new_tokens"], serving["slots"]) == (4, 8, 4)
    # The run raises unless each of the 4 completions streamed content and reported 8 tokens; the engine decoded
    # them in steps of at most 4 busy slots: a completion's first token comes from its prompt's prefill and the 7
    # others from 7 steps, so at least 7 steps (all 4 prefilled together, as requests that arrive during one step
    # are) and at most 4 x 8 (one request at a time, each with one more step in flight when it ends).
    assert 7 <= serving["decode_steps"] <= 4 * 8
    assert 1 <= serving["prefills"] <= 4
    assert 0 < serving["ttft_p50_ms"] <= serving["ttft_p95_ms"] <= serving["ttft_max_ms"]
    assert set(section["ceilings"]) == {"fusetune", "hf"}
    assert "| serving: total |" in completed.stdout
