"""`fusetune families propose`: a family recognised by structure, written out as a proposed table row."""

from __future__ import annotations

from typer.testing import CliRunner

from fusetune.cli import app
from tests.models.tiny import tiny_config

runner = CliRunner()


def test_propose_from_a_model_folder_prints_a_row_of_the_table(tmp_path) -> None:
    tiny_config("granite").save_pretrained(tmp_path / "granite")
    result = runner.invoke(app, ["families", "propose", str(tmp_path / "granite")])
    assert result.exit_code == 0, result.output
    row = result.output[result.output.index("FamilySpec(") :]
    namespace: dict = {}
    exec("from fusetune.models.families import FamilySpec\nrow = " + row.rstrip().rstrip(","), namespace)
    spec = namespace["row"]
    assert spec.model_type == "granite" and spec.causal_lm_class == "GraniteForCausalLM"
    assert spec.residual_multiplier_attribute == "residual_multiplier"
    assert spec.logit_scale_config_attribute == "logits_scaling" and spec.logit_scale_operation == "divide"
    assert "# granite: recognised" in result.output


def test_propose_says_what_is_left_and_that_table_rows_keep_priority() -> None:
    result = runner.invoke(app, ["families", "propose", "glm4"])
    assert result.exit_code == 0, result.output
    assert (
        "# glm4: partly" in result.output
        and "left  rotary apply_rotary_pos_emb: probe failed" in result.output
    )
    assert "rope_function=None" in result.output

    table = runner.invoke(app, ["families", "propose", "qwen2"])
    assert table.exit_code == 0 and "has a row in the table, which keeps priority" in table.output


def test_propose_refuses_what_it_cannot_build() -> None:
    result = runner.invoke(app, ["families", "propose", "not_a_model_type"])
    assert result.exit_code == 2 and "cannot build a miniature" in result.output
