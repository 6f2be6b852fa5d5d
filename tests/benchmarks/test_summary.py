"""The committed markdown of the results is what benchmarks.summary makes of the committed JSON, so a number
can change only in a results file; and every section has a renderer and a headline."""

import json

import pytest

from benchmarks import harness, summary


def test_committed_markdown_is_generated_from_the_committed_json():
    for path, text in summary.generated_files(harness.RESULTS_DIR).items():
        assert path.exists(), f"{path.name} is missing: run python3 -m benchmarks.summary"
        assert path.read_text() == text, (
            f"{path.name} differs from its JSON: run python3 -m benchmarks.summary"
        )


def test_readme_table_is_generated_from_the_committed_json():
    readme = summary.README_PATH.read_text()
    block = summary.render_readme_block(harness.RESULTS_DIR)
    assert summary.readme_with_block(readme, block) == readme, "run python3 -m benchmarks.summary"


def test_every_results_file_is_a_topic_file_whose_sections_render():
    paths = sorted(harness.RESULTS_DIR.glob("*.json"))
    assert paths
    for path in paths:
        content = json.loads(path.read_text())
        assert content["topic"] in harness.TOPICS and path.stem.endswith("-" + content["topic"])
        for name, section in content["sections"].items():
            assert section["benchmark"] in summary.RENDERERS, (path.name, name)
            assert summary.HEADLINES[section["benchmark"]](section), (path.name, name)


def test_markdown_files_without_json_are_not_left_behind():
    generated = set(summary.generated_files(harness.RESULTS_DIR))
    assert set(harness.RESULTS_DIR.glob("*.md")) == generated


def test_a_section_written_keeps_the_others_and_merge_in_replaces_by_section(tmp_path):
    ops = harness.Benchmark("ops", topic="kernels")
    sustained = harness.Benchmark("sustained", topic="kernels")
    ops.write(tmp_path, "h100", {"rows": [1]})
    sustained.write(tmp_path, "h100", {"rows": [2]})
    ops.write(tmp_path, "h100", {"rows": [3]}, section="cce-sweep")
    path = tmp_path / "h100-kernels.json"
    content = json.loads(path.read_text())
    assert content["topic"] == "kernels"
    assert content["sections"] == {
        "ops": {"benchmark": "ops", "rows": [1]},
        "sustained": {"benchmark": "sustained", "rows": [2]},
        "cce-sweep": {"benchmark": "ops", "rows": [3]},
    }

    session = tmp_path / "session"
    sustained.write(session, "h100", {"rows": [4]})
    summary.merge_in([session / "h100-kernels.json"], tmp_path)
    merged = json.loads(path.read_text())["sections"]
    assert [merged[name]["rows"] for name in ("ops", "sustained", "cce-sweep")] == [[1], [4], [3]]


@pytest.mark.parametrize("legacy", [True, False])
def test_a_merge_reads_its_section_from_a_topic_file_or_a_file_of_one_benchmark(tmp_path, legacy):
    import argparse

    e2e = harness.Benchmark("e2e", topic="step")
    source = tmp_path / "earlier.json"
    if legacy:
        harness.write_json(source, {"rows": ["earlier"]})
    else:
        e2e.write(tmp_path / "topic", "h100", {"rows": ["earlier"]}, section="e2e-packed")
        source = tmp_path / "topic" / "h100-step.json"
    args = argparse.Namespace(out=tmp_path, merge=False, merge_from=source, section="e2e-packed")
    assert e2e.previous(args, "h100")["rows"] == ["earlier"]
    assert e2e.previous(argparse.Namespace(out=tmp_path, merge=True, section="e2e"), "h100") is None
