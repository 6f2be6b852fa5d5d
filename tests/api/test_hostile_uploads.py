"""Hostile training files never reach a 500: every upload is stored (200) or refused (400) naming the first bad
line, and a refused upload leaves no file and no row. An unexpected error is a 500 in the one error shape with a
request id that the server log has too, counted in Prometheus.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, note
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from fusetune.api.app import create_app
from fusetune.api.file_validation import MAX_NESTING_DEPTH, UTF8_BOM
from fusetune.db.models import File
from fusetune.spec.examples import CHAT_ROLES
from tests.api.conftest import AUTH
from tests.api.test_validation import GOOD_LINE, _assert_error_shape, _count, _upload

QUESTION = {"role": "user", "content": "2 + 2?"}
ANSWER = {"role": "assistant", "content": "4"}


def _upload_bytes(client, data: bytes):
    return client.post("/v1/files", files={"file": ("train.jsonl", data)}, data={"purpose": "fine-tune"})


def _nested_extra(levels: int) -> str:
    """A chat example whose message carries an extra field of `levels` nested arrays: the line nests
    3 + levels deep (the example object, the messages list, the message)."""
    head = json.dumps({"messages": [QUESTION, {**ANSWER, "extra": "HOLE"}]})
    return head.replace('"HOLE"', "[" * levels + "]" * levels)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (_nested_extra(5000), f"nested deeper than the limit of {MAX_NESTING_DEPTH} levels"),
        ("[" * 100_000 + "]" * 100_000, f"nested deeper than the limit of {MAX_NESTING_DEPTH} levels"),
        ("[" * 100_000, f"nested deeper than the limit of {MAX_NESTING_DEPTH} levels"),
        (_nested_extra(MAX_NESTING_DEPTH - 2), f"nested deeper than the limit of {MAX_NESTING_DEPTH} levels"),
        (
            '{"text": "a", "n": ' + "7" * 100_000 + "}",
            "a number at column 20 is out of range: numbers must fit",
        ),
        ('{"text": "a", "n": 1e400}', "a number at column 20 is out of range: numbers must fit"),
        ('{"text": "\\ud800"}', "not valid JSON"),
        ('{"text": NaN}', "not valid JSON"),
    ],
    ids=[
        "extra-5000-deep",
        "100000-deep",
        "100000-open",
        "one-over-limit",
        "100000-digits",
        "1e400",
        "lone-surrogate",
        "nan",
    ],  # fmt: skip
)
def test_hostile_line_is_a_400_naming_the_line_and_the_limit(client, settings, line, expected):
    error = _assert_error_shape(_upload(client, f"{GOOD_LINE}\n{line}\n{GOOD_LINE}\n"), 400, "file")
    assert f"line 2: {expected}" in error["message"], error["message"]
    assert "line 1" not in error["message"] and "line 3" not in error["message"]
    assert len(error["message"]) < 500
    assert list(settings.files_dir.iterdir()) == [] and _count(settings, File) == 0


def test_nesting_up_to_the_limit_is_accepted(client):
    response = _upload(client, _nested_extra(MAX_NESTING_DEPTH - 3) + "\n")
    assert response.status_code == 200, response.text


def test_byte_order_mark_is_accepted_at_the_start_only(client, settings):
    response = _upload_bytes(client, UTF8_BOM + f"{GOOD_LINE}\r\n{GOOD_LINE}\r\n".encode())
    assert response.status_code == 200, response.text
    assert response.json()["example_count"] == 2
    error = _assert_error_shape(_upload_bytes(client, f"{GOOD_LINE}\n".encode() + UTF8_BOM + GOOD_LINE.encode()),
                                400, "file")  # fmt: skip
    assert "line 2: not valid JSON" in error["message"]
    assert _count(settings, File) == 1


def test_prompt_completion_with_a_text_of_another_type_is_counted(client):
    response = _upload(client, json.dumps({"prompt": "2 + 2 =", "completion": " 4", "text": 5}))
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------------------------ generated files
#
# Each generated line carries what the validator must make of it: "example" (counted), "blank" (skipped) or
# "bad" (refused, with its line number). The file's expected answer follows from its lines alone.

_text = st.text(max_size=40)  # any code point but lone surrogates, control characters included
_nonempty_text = st.text(min_size=1, max_size=40)


def _dumps(value, ascii_only: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":"))


@st.composite
def _example(draw) -> dict:
    kind = draw(st.sampled_from(["chat", "prompt", "text"]))
    if kind == "prompt":
        return {"prompt": draw(_text), "completion": draw(_nonempty_text)}
    if kind == "text":
        return {"text": draw(_nonempty_text)}
    turns = draw(st.lists(st.tuples(st.sampled_from(CHAT_ROLES), _text), max_size=4))
    messages = [{"role": role, "content": content} for role, content in turns]
    return {"messages": [*messages, {"role": "assistant", "content": draw(_text)}]}


@st.composite
def _line(draw) -> tuple[str, bytes]:
    ascii_only = draw(st.booleans())
    kind = draw(st.sampled_from(["example", "example", "huge", "nested", "number", "blank", "broken", "deep",
                                 "digits", "not-example", "bytes", "surrogate", "bom"]))  # fmt: skip
    if kind == "example":
        return "example", _dumps(draw(_example()), ascii_only).encode()
    if kind == "huge":
        completion = draw(st.characters()) * draw(st.integers(10_000, 300_000))
        return "example", _dumps({"prompt": "say it", "completion": completion}, ascii_only).encode()
    if kind == "nested":
        levels = draw(st.integers(1, MAX_NESTING_DEPTH + 10))
        return ("example" if 3 + levels <= MAX_NESTING_DEPTH else "bad"), _nested_extra(levels).encode()
    if kind == "number":
        digits = draw(st.integers(1, 308))
        return "example", b'{"text":"a","n":' + b"9" * digits + b"}"
    if kind == "blank":
        return "blank", draw(st.sampled_from([b"", b"   ", b"\t", b"\r", b" \r"]))
    if kind == "broken":
        text = _dumps(draw(_example()), ascii_only)
        return "bad", text[: draw(st.integers(1, len(text) - 1))].encode()
    if kind == "deep":
        depth = draw(st.integers(MAX_NESTING_DEPTH + 1, 100_000))
        return "bad", draw(st.sampled_from([b"[", b'{"a":'])) * depth + draw(
            st.sampled_from([b"", b"]" * depth])
        )
    if kind == "digits":
        return "bad", b'{"text":"a","n":' + b"1" * draw(st.integers(310, 100_000)) + b"}"
    if kind == "not-example":
        value = draw(st.recursive(st.none() | st.booleans() | st.integers() | _text,
                                  lambda inner: st.lists(inner, max_size=3), max_leaves=6))  # fmt: skip
        return "bad", _dumps(value, ascii_only).encode()
    if kind == "bytes":
        return "bad", b"\xff" + draw(st.binary(max_size=30)).replace(b"\n", b"")
    if kind == "surrogate":
        return "bad", b'{"text":"\\udc80 odd"}'
    return "bom", UTF8_BOM + GOOD_LINE.encode()  # bad anywhere but at the file's start


@st.composite
def _jsonl_file(draw) -> tuple[list[str], bytes]:
    lines = draw(st.lists(_line(), min_size=1, max_size=6))
    endings = draw(st.lists(st.sampled_from([b"\n", b"\r\n"]), min_size=len(lines), max_size=len(lines)))
    if draw(st.booleans()):  # one byte order mark at the start is no part of the first line
        lines[0] = ("bad" if lines[0][0] == "bom" else lines[0][0], UTF8_BOM + lines[0][1])
    elif lines[0][0] == "bom":
        lines[0] = ("example", lines[0][1])
    lines = [("bad" if kind == "bom" else kind, raw) for kind, raw in lines]
    data = b"".join(raw + ending for (_, raw), ending in zip(lines, endings, strict=True))
    if draw(st.booleans()):
        data = data.removesuffix(endings[-1])
    return [kind for kind, _ in lines], data


@pytest.fixture(scope="module")
def module_client(tmp_path_factory):
    from fusetune.config import Settings
    from fusetune.db.migrate import upgrade

    module_settings = Settings(data_dir=tmp_path_factory.mktemp("hostile") / "data")
    module_settings.ensure_dirs()
    upgrade(module_settings.database_url)
    with TestClient(create_app(module_settings), headers=AUTH) as client:
        yield client, module_settings


@hypothesis_settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(generated=_jsonl_file())
def test_generated_files_are_stored_or_refused_naming_the_first_bad_line(module_client, generated):
    client, app_settings = module_client
    kinds, data = generated
    files_before, rows_before = sorted(app_settings.files_dir.iterdir()), _count(app_settings, File)
    response = _upload_bytes(client, data)
    note(f"{kinds} {data[:300]!r}")
    bad_lines = [number for number, kind in enumerate(kinds, start=1) if kind == "bad"]
    n_examples = kinds.count("example")
    if not bad_lines and n_examples:
        assert response.status_code == 200, response.text
        assert response.json()["example_count"] == n_examples
        assert len(list(app_settings.files_dir.iterdir())) == len(files_before) + 1
        assert _count(app_settings, File) == rows_before + 1
        return
    error = _assert_error_shape(response, 400, "file")
    assert error["code"] == "invalid_file"
    if bad_lines:
        assert re.search(rf"\bline {bad_lines[0]}: ", error["message"]), (kinds, error["message"])
        reported = [int(n) for n in re.findall(r"\bline (\d+): ", error["message"])]
        assert set(reported) <= set(bad_lines), (kinds, error["message"])
    else:
        assert "holds no examples" in error["message"]
    assert sorted(app_settings.files_dir.iterdir()) == files_before
    assert _count(app_settings, File) == rows_before


# ------------------------------------------------------------------------------------- unexpected errors


def test_unexpected_error_is_a_500_with_a_logged_request_id_and_counted(settings, monkeypatch, caplog):
    def broken_validator(_stream, *_limits):
        raise RuntimeError("internal detail that must not leak")

    monkeypatch.setattr("fusetune.api.routes.files.validate_chat_jsonl", broken_validator)
    caplog.set_level(logging.ERROR, logger="fusetune.api.errors")
    with TestClient(create_app(settings), headers=AUTH, raise_server_exceptions=False) as client:
        response = _upload(client, GOOD_LINE)
        error = _assert_error_shape(response, 500)
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        request_id = response.headers["X-Request-Id"]
        assert re.fullmatch(r"req_[0-9a-f]{16}", request_id) and request_id in error["message"]
        assert "internal detail" not in response.text and "Traceback" not in response.text
        logged = [r for r in caplog.records if request_id in r.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info[0] is RuntimeError
        metrics = client.get("/metrics").text
    assert 'fusetune_http_unexpected_errors_total{exception="RuntimeError"} 1.0' in metrics
    assert 'fusetune_http_requests_total{method="POST",route="/v1/files",status="500"} 1.0' in metrics
    assert list(settings.files_dir.iterdir()) == [] and _count(settings, File) == 0
