"""Strict input outside the job specification: tenant names, upload filenames, duplicate form parts and
Authorization headers, and a request body that stalls."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

from fusetune.api.middleware import BodyReadTimeout
from fusetune.cli import app as cli
from fusetune.db.migrate import upgrade

LINE = b'{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}\n'


def _multipart(filename: bytes, purposes: tuple[str, ...] = ("fine-tune",), files: int = 1) -> bytes:
    parts = [
        f'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{p}\r\n'.encode() for p in purposes
    ]
    parts += [b'--B\r\nContent-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n\r\n' + LINE
              + b"\r\n"] * files  # fmt: skip
    return b"".join(parts) + b"--B--\r\n"


def _upload(client, body: bytes):
    return client.post("/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=B"})


@pytest.mark.parametrize("tenant", ["", " ", "a/b", "../x", "-lead", "x" * 65, "tab\there"])
def test_keys_create_refuses_an_invalid_tenant_name(tmp_path, tenant):
    result = CliRunner().invoke(cli, ["keys", "create", "--tenant", tenant, "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "invalid tenant name" in result.output, result.output


def test_keys_create_takes_a_valid_tenant_name(tmp_path):
    upgrade(f"sqlite:///{tmp_path / 'fusetune.db'}")
    result = CliRunner().invoke(cli, ["keys", "create", "--tenant", "acme.eu-1", "--data-dir", str(tmp_path)])
    assert result.exit_code == 0 and "\tacme.eu-1\tsk-ft-" in result.output, result.output


@pytest.mark.parametrize("name", [b"a\x00b.jsonl", b"a\nb.jsonl", b"a\x1b[31mb.jsonl", b"a\x7fb.jsonl"])
def test_a_control_character_in_a_filename_is_refused(client, name):
    response = _upload(client, _multipart(name))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "file" and "control character" in response.text
    assert client.get("/v1/files").json()["data"] == []
    assert _upload(client, _multipart(b"ok.jsonl")).status_code == 200


def test_a_second_file_or_purpose_part_is_refused(client):
    for body, param in ((_multipart(b"a.jsonl", files=2), "file"),
                        (_multipart(b"a.jsonl", purposes=("fine-tune", "fine-tune")), "purpose")):  # fmt: skip
        response = _upload(client, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_a_second_authorization_header_is_refused(client, settings):
    key = f"Bearer {settings.dev_api_key}"
    response = client.get("/v1/files", headers=[("Authorization", key), ("Authorization", "Bearer other")])
    assert response.status_code == 400 and response.json()["error"]["code"] == "duplicate_header"


def test_a_stalled_request_body_is_answered_408():
    """The middleware alone: a client that sends part of a body, then nothing."""
    sent: list[dict] = []

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"truncated"})

    async def main() -> None:
        first = True

        async def receive():
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": b"--B\r\n", "more_body": True}
            await asyncio.Event().wait()  # the rest never comes

        async def send(message):
            sent.append(message)

        await BodyReadTimeout(app, timeout_s=0.05)({"type": "http", "method": "POST"}, receive, send)

    asyncio.run(main())
    assert sent[0]["status"] == 408 and b"stalled" in sent[1]["body"]


@pytest.mark.parametrize("length", [256, 1000, 5000])
def test_a_filename_over_the_limit_is_refused_saying_so(client, length):
    response = _upload(client, _multipart(b"a" * (length - len(".jsonl")) + b".jsonl"))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and error["code"] == "invalid_filename"
    assert "at most 255 characters" in error["message"] or "over the limit of 255" in error["message"], error
    assert client.get("/v1/files").json()["data"] == []
    assert _upload(client, _multipart(b"a" * 249 + b".jsonl")).status_code == 200
