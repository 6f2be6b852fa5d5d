"""Each rank's memory peaks as a step reports them: with the node that holds the rank and its host. The trainer's
numbers themselves are checked where a run reports them (tests/api/test_dashboard.py: two ranks on one host,
through SQL, the API and the page; tests/worker/test_ray_engine.py: two nodes of two ranks)."""

from __future__ import annotations

from fusetune.worker.train.metrics import rank_memory


def test_each_ranks_peaks_carry_its_node_and_host():
    peaks = [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0), (7.0, 8.0)]
    entries = rank_memory(peaks, ["node-a", "node-a", "node-b", "node-b"], local_world_size=2)
    assert [(e["rank"], e["node"], e["host"]) for e in entries] == [
        (0, 0, "node-a"), (1, 0, "node-a"), (2, 1, "node-b"), (3, 1, "node-b"),
    ]  # fmt: skip
    assert [(e["peak_memory_allocated_bytes"], e["peak_memory_reserved_bytes"]) for e in entries] == peaks
    # One node of four ranks: the same four entries, all on node 0.
    assert {e["node"] for e in rank_memory(peaks, ["node-a"] * 4, local_world_size=4)} == {0}
