"""GET /v1/fine_tuning/options against the job specification it is read from: every default, bound and choice
equals the spec models' own (read here from their fields, not from the JSON schema the endpoint reads), every
method and precision mode is offered, and a request built from the answer alone is accepted."""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

import annotated_types
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from fusetune.api.app import create_app
from fusetune.spec.hyperparameters import HyperparametersRequest, JobHyperparameters, LoraSpec
from fusetune.spec.methods import DEFAULT_METHOD, METHODS, hyperparameters_request
from fusetune.spec.precision import AUTO, CPU_DEFAULT, GPU_DEFAULT, PRECISION_NAMES, PRECISIONS

URL = "/v1/fine_tuning/options"
# A line of each training file format (fusetune/spec/examples.py).
LINES = {
    "supervised": '{"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}\n',
    "reinforcement": '{"messages": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}\n',
    "preference": '{"input": {"messages": [{"role": "user", "content": "1 + 1?"}]}, '
    '"preferred_output": [{"role": "assistant", "content": "2"}], '
    '"non_preferred_output": [{"role": "assistant", "content": "3"}]}\n',
}
# What a method's request gives beside its hyperparameters, which no option offers (reinforcement's grader).
BESIDE = {
    "reinforcement": {"grader": {"type": "string_check", "name": "exact", "operation": "eq",
                                 "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}"}},
}  # fmt: skip


@pytest.fixture
def options(client) -> dict[str, Any]:
    response = client.get(URL)
    assert response.status_code == 200, response.text
    return response.json()


def _bounds(model: type[BaseModel], name: str) -> dict[str, Any]:
    bounds = {"minimum": None, "exclusive_minimum": False, "maximum": None, "exclusive_maximum": False}
    for constraint in model.model_fields[name].metadata:
        if isinstance(constraint, annotated_types.Ge):
            bounds.update(minimum=constraint.ge)
        elif isinstance(constraint, annotated_types.Gt):
            bounds.update(minimum=constraint.gt, exclusive_minimum=True)
        elif isinstance(constraint, annotated_types.Le):
            bounds.update(maximum=constraint.le)
        elif isinstance(constraint, annotated_types.Lt):
            bounds.update(maximum=constraint.lt, exclusive_maximum=True)
    return bounds


def _choices(model: type[BaseModel], name: str) -> list[str] | None:
    annotation = model.model_fields[name].annotation
    literals = [annotation] if get_origin(annotation) is Literal else get_args(annotation)
    return [value for part in literals if get_origin(part) is Literal for value in get_args(part)] or None


def _accepts(request: type[BaseModel], name: str, value: Any) -> bool:
    try:
        request.model_validate({name: value})
    except ValidationError as exc:
        return not any(error["loc"][:1] == (name,) for error in exc.errors())
    return True


def _assert_matches(offered: dict[str, Any], decided: type[BaseModel], request: type[BaseModel]) -> None:
    """`offered` (name -> option) against the fields of `decided` as `request` takes them: the default and
    whether "auto" or null is accepted are the request's, the bounds and choices the decided value's."""
    assert list(offered) == [name for name in request.model_fields if name in decided.model_fields]
    for name, option in offered.items():
        assert option["default"] == request.model_fields[name].default, name
        assert {key: option[key] for key in _bounds(decided, name)} == _bounds(decided, name), name
        assert option["choices"] == _choices(decided, name), name
        assert option["auto"] == _accepts(request, name, AUTO), name
        assert option["nullable"] == _accepts(request, name, None), name


def test_hyperparameters_have_the_specs_defaults_bounds_and_choices(options):
    offered = options["hyperparameters"]
    _assert_matches(offered, JobHyperparameters, HyperparametersRequest)
    _assert_matches(offered["lora"]["fields"], LoraSpec, LoraSpec)
    assert (offered["max_seq_length"]["default"], offered["max_seq_length"]["maximum"]) == (512, 131072)
    assert offered["n_epochs"]["type"] == "integer" and offered["warmup_ratio"]["type"] == "number"
    assert offered["packing"]["type"] == "boolean" and offered["lora"]["type"] == "object"
    assert offered["batch_size"]["description"] == JobHyperparameters.model_fields["batch_size"].description


def test_every_method_and_precision_mode_is_offered(options):
    assert list(options["methods"]) == list(METHODS) and options["default_method"] == DEFAULT_METHOD
    for name, method in METHODS.items():
        offered = options["methods"][name]
        assert offered["description"] == method.description
        assert offered["supports_packing"] == method.supports_packing
        assert offered["example_format"] == method.example_format.name
        if method.settings is None:
            assert offered["settings"] == {}
        else:
            _assert_matches(offered["settings"], method.settings, hyperparameters_request(name))
    assert options["methods"]["dpo"]["settings"]["beta"]["maximum"] == 2
    assert list(options["precisions"]) == list(PRECISIONS)
    assert options["hyperparameters"]["precision"]["choices"] == list(PRECISION_NAMES)
    for name, mode in PRECISIONS.items():
        assert options["precisions"][name] == {"description": mode.description, "needs_gpu": mode.needs_gpu}
    assert options["precision_auto"] == {"gpu": GPU_DEFAULT, "cpu": CPU_DEFAULT}


def test_a_job_made_of_the_offered_defaults_is_created_for_every_method(client, options):
    """What the dashboard sends when nothing is changed: each offered default, for every method."""
    shared = {name: option["default"] for name, option in options["hyperparameters"].items()}
    for name, method in options["methods"].items():
        file_id = client.post(
            "/v1/files",
            files={"file": ("t.jsonl", LINES[method["example_format"]] * 4)},
            data={"purpose": "fine-tune"},
        ).json()["id"]
        settings = {setting: option["default"] for setting, option in method["settings"].items()}
        body = {"model": "tiny", "training_file": file_id,
                "method": {"type": name, name: {"hyperparameters": shared | settings, **BESIDE.get(name, {})}}}  # fmt: skip
        response = client.post("/v1/fine_tuning/jobs", json=body)
        assert response.status_code == 200, response.text
        job = response.json()
        assert job["method"]["type"] == name and job["hyperparameters"]["max_seq_length"] == 512


def test_the_options_need_a_key_and_are_documented(settings, options):
    anonymous = TestClient(create_app(settings))
    assert anonymous.get(URL).status_code == 401
    schema = anonymous.get("/openapi.json").json()
    answer = schema["paths"][URL]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer == {"$ref": "#/components/schemas/JobOptions"}
    assert {"hyperparameters", "methods", "precisions", "precision_auto"} <= set(
        schema["components"]["schemas"]["JobOptions"]["properties"]
    )
