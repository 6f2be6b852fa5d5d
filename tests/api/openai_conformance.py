"""Response bodies checked against OpenAI's OpenAPI description (tests/data/openai_openapi/, spec 2.3.0).

A `Recorder` is an httpx response hook: every JSON response of an operation the spec declares (files,
fine-tuning, graders, models, chat completions, evals) is recorded with its method, path template and status, and
`problems()` validates each body against the schema the spec gives that operation's success status (200, or 201
where it declares 201: a success answered with another status is a problem too) or ErrorResponse (any other
status). An event stream (`stream: true` of a chat completion) is recorded event by event: each `data:` event is
validated against the stream's schema (CreateChatCompletionStreamResponse), and the stream must end with
`data: [DONE]`. The `client` fixture of tests/api records every call; tests/api/test_openai_conformance.py drives
each operation itself.

Errors are ErrorResponse (`{"error": {...}}`) for every operation. Three evals operations declare their 400 or
404 body as `Error`, the object inside ErrorResponse; OpenAI's API and its SDKs (which read the body's `error`)
use the envelope there as everywhere, and ErrorResponse validates that object against `Error` anyway.

The deliberate differences are `EXCEPTIONS`, each with its reason; anything else the spec rejects is a bug.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).parents[1] / "data" / "openai_openapi" / "openapi.subset.json"
SPEC_URI = "urn:openai-openapi"
API_PREFIX = "/v1"


@dataclass(frozen=True)
class Exception_:
    """Bodies of `operation` (METHOD template) that the spec's schema rejects on purpose: `applies` picks
    them, `adjust` gives the body fusetune would send if it followed the spec there, validated instead."""

    operation: str
    reason: str
    applies: object  # (body) -> bool
    adjust: object  # (body) -> body


# What fusetune's jobs may hold that OpenAI's FineTuningJob schema does not, each rewritten to what the schema
# takes before the job is validated (every other field of the job is still checked):
# - "status": "paused": OpenAI's own example response of POST .../pause shows it, and a paused job is read back
#   so; the schema's status enum (validating_files ... cancelled) has not caught up. Read as "running".
# - a method OpenAI does not offer (`simpo`, fusetune/spec/methods.py): its `method` is left out (the schema
#   does not require one); supervised, dpo and reinforcement jobs are checked in full.
# - an integration OpenAI does not offer (`mlflow`, fusetune/spec/integrations.py): left out; `wandb` ones are
#   checked.
OPENAI_METHODS = ("supervised", "dpo", "reinforcement")
OPENAI_INTEGRATIONS = ("wandb",)


def as_openai_job(job: dict) -> dict:
    job = dict(job)
    if job.get("status") == "paused":
        job["status"] = "running"
    if isinstance(job.get("method"), dict) and job["method"].get("type") not in OPENAI_METHODS:
        del job["method"]
    if isinstance(job.get("integrations"), list):
        job["integrations"] = [i for i in job["integrations"] if i.get("type") in OPENAI_INTEGRATIONS]
    return job


JOB_OPERATIONS = (
    "POST /fine_tuning/jobs",
    "GET /fine_tuning/jobs/{fine_tuning_job_id}",
    "POST /fine_tuning/jobs/{fine_tuning_job_id}/cancel",
    "POST /fine_tuning/jobs/{fine_tuning_job_id}/pause",
    "POST /fine_tuning/jobs/{fine_tuning_job_id}/resume",
)


# An eval data file has purpose "evals": OpenAI's upload request takes it (CreateFileRequest), and its file object's
# purpose enum has not caught up. Read as "user_data" (every other field is still checked).
def as_openai_file(file: dict) -> dict:
    return {**file, "purpose": "user_data"} if file.get("purpose") == "evals" else file


EXCEPTIONS: tuple[Exception_, ...] = (
    *(
        Exception_(
            operation,
            "an eval data file (as_openai_file)",
            lambda body: body.get("purpose") == "evals",
            as_openai_file,
        )  # fmt: skip
        for operation in ("POST /files", "GET /files/{file_id}")
    ),
    Exception_(
        "GET /files",
        "the listed files (as_openai_file)",
        lambda body: isinstance(body.get("data"), list),
        lambda body: {**body, "data": [as_openai_file(file) for file in body["data"]]},
    ),
    *(
        Exception_(
            operation,
            "a job (as_openai_job)",
            lambda body: body.get("object") == "fine_tuning.job",
            as_openai_job,
        )  # fmt: skip
        for operation in JOB_OPERATIONS
    ),
    Exception_(
        "GET /fine_tuning/jobs",
        "the listed jobs (as_openai_job)",
        lambda body: isinstance(body.get("data"), list),
        lambda body: {**body, "data": [as_openai_job(job) for job in body["data"]]},
    ),
    # An empty page has no first or last object: null, as the checkpoints list's schema has it (the files and
    # evals lists' declare a string, with no value for an empty page).
    *(
        Exception_(
            operation,
            "first_id and last_id of an empty page",
            lambda body: (
                body.get("data") == [] and body.get("first_id") is None and body.get("last_id") is None
            ),
            lambda body: {**body, "first_id": "", "last_id": ""},
        )  # fmt: skip
        for operation in (
            "GET /files",
            "GET /evals",
            "GET /evals/{eval_id}/runs",
            "GET /evals/{eval_id}/runs/{run_id}/output_items",
        )  # fmt: skip
    ),
    # fusetune's dry run (`"dry_run": true` in the request, a fusetune field) answers the job's estimate, an
    # object of its own (fine_tuning.job.estimate); no job is created.
    Exception_(
        "POST /fine_tuning/jobs",
        "a dry run's estimate",
        lambda body: body.get("object") == "fine_tuning.job.estimate",
        lambda body: None,
    ),
)
# Fields fusetune adds (a job's attempts, resolved, training_seconds; a file's example_count, token_estimate,
# method; a checkpoint's best) need no exception: no schema of these operations forbids other properties.


EVENT_STREAM = "text/event-stream"
DONE = "[DONE]"


@dataclass(frozen=True)
class Recorded:
    """One response. `body` is the JSON body, or for an event stream the list of its `data:` events, each
    parsed (the final `[DONE]` as the string)."""

    method: str
    path: str
    template: str
    status: int
    body: object
    media_type: str = "application/json"

    @property
    def operation(self) -> str:
        return f"{self.method} {self.template}"


def _exclusive_bounds_as_numbers(node: object) -> object:
    """The description is OpenAPI 3.1 (JSON Schema 2020-12), where exclusiveMinimum is a number, but a few of
    its schemas keep 3.0's boolean form (`minimum: 0, exclusiveMinimum: true`: above 0), which 2020-12 would
    read as "above 1" (true is 1). Rewritten to the 2020-12 form on loading; the vendored file is unchanged."""
    if isinstance(node, list):
        return [_exclusive_bounds_as_numbers(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _exclusive_bounds_as_numbers(value) for key, value in node.items()}
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(exclusive), bool):
            if node.pop(exclusive):
                node[exclusive] = node.pop(bound)
    return node


EVAL_ITEM = "#/components/schemas/EvalItem"


def _eval_messages_any_of(node: object) -> object:
    """An eval's message (a template's, a label_model criterion's input) is `oneOf` EvalItem and a simpler
    message schema (EasyInputMessage, or an inline role and content). Neither forbids the other's fields, so every
    message, OpenAI's own examples included (`{"role": "user", "content": "{{ item.question }}"}`), is valid
    under both and so under no `oneOf`. Read as `anyOf` on loading: a message must still be valid under one of
    them. The vendored file is unchanged."""
    if isinstance(node, list):
        return [_eval_messages_any_of(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _eval_messages_any_of(value) for key, value in node.items()}
    if any(isinstance(member, dict) and member.get("$ref") == EVAL_ITEM for member in node.get("oneOf", ())):
        node["anyOf"] = node.pop("oneOf")
    return node


def _nullable_as_null_type(node: object) -> object:
    """OpenAPI 3.0's `nullable: true`, which some of the 3.1 description's schemas keep (a chat completion chunk's
    `finish_reason`, its `usage`, ...): JSON Schema 2020-12 ignores the keyword, so the schema would reject the
    null it allows. Rewritten to `anyOf: [schema, {type: null}]` on loading; the vendored file is unchanged."""
    if isinstance(node, list):
        return [_nullable_as_null_type(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable_as_null_type(value) for key, value in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


@cache
def spec() -> dict:
    loaded = json.loads(SPEC_PATH.read_text())
    return _eval_messages_any_of(_nullable_as_null_type(_exclusive_bounds_as_numbers(loaded)))


@cache
def _registry() -> Registry:
    return Registry().with_resource(SPEC_URI, Resource(contents=spec(), specification=DRAFT202012))


def _pointer(*parts: str) -> str:
    return "/".join(part.replace("~", "~0").replace("/", "~1") for part in parts)


@cache
def _validator(pointer: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"{SPEC_URI}#/{pointer}"}, registry=_registry())


@cache
def _templates() -> tuple[tuple[re.Pattern, str, frozenset[str]], ...]:
    found = []
    for template, item in spec()["paths"].items():
        # A model's id may hold "/" and ":" (fusetune serves /v1/models/{model_id:path}).
        pattern = re.sub(r"\\\{model\\\}", ".+", re.escape(template))
        pattern = re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", pattern)
        methods = frozenset(m.upper() for m in item if m in ("get", "post", "delete"))
        found.append((re.compile(pattern + "$"), template, methods))
    return tuple(found)


def operation_of(method: str, path: str) -> str | None:
    """The spec's path template of a request, or None when the spec does not declare the operation."""
    if not path.startswith(API_PREFIX):
        return None
    path = path.removeprefix(API_PREFIX)
    for pattern, template, methods in _templates():
        if method in methods and pattern.match(path):
            return template
    return None


def declared_operations() -> set[str]:
    return {f"{m} {t}" for _, t, methods in _templates() for m in methods}


def success_status(method: str, template: str) -> int:
    """The success status the spec declares for the operation (201 for creating an eval or a run, else 200)."""
    declared = [int(s) for s in spec()["paths"][template][method.lower()]["responses"] if s.startswith("2")]
    (status,) = declared
    return status


def schema_pointer(record: Recorded) -> str:
    if not 200 <= record.status < 300:
        return _pointer("components", "schemas", "ErrorResponse")
    return _pointer(
        "paths", record.template, record.method.lower(), "responses", str(success_status(record.method,
        record.template)), "content", record.media_type, "schema",
    )  # fmt: skip


def _parse_events(text: str) -> list[object]:
    """The `data:` fields of a server-sent event stream, one per event, each JSON-parsed but `[DONE]`."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(
            line.removeprefix("data:").removeprefix(" ")
            for line in block.split("\n")
            if line.startswith("data:")
        )
        if data:
            events.append(data if data == DONE else json.loads(data))
    return events


def _validate(record: Recorded, body: object, where: str) -> list[str]:
    body = _adjusted(record, body)
    if body is None:
        return []
    errors = sorted(_validator(schema_pointer(record)).iter_errors(body), key=lambda e: list(e.absolute_path))
    return [f"{where}: at {list(e.absolute_path)}: {e.message[:300]}" for e in errors]


def _adjusted(record: Recorded, body: object) -> object:
    """The body after each deliberate exception that applies to it (None: nothing of it to validate)."""
    for exception in EXCEPTIONS:
        if exception.operation == record.operation and 200 <= record.status < 300 and exception.applies(body):
            body = exception.adjust(body)
            if body is None:
                return None
    return body


def problems(record: Recorded) -> list[str]:
    """What the spec finds wrong with the recorded body (after the deliberate exceptions), one line each."""
    where = f"{record.method} {record.path} -> {record.status}"
    if 200 <= record.status < 300 and record.status != (
        declared := success_status(record.method, record.template)
    ):
        return [f"{where}: the spec declares {declared} for this operation's success"]
    if record.media_type != EVENT_STREAM:
        return _validate(record, record.body, where)
    events = record.body
    found = [] if events and events[-1] == DONE else [f"{where}: the stream does not end with data: {DONE}"]
    for number, event in enumerate(events):
        if event == DONE:
            if number != len(events) - 1:
                found.append(f"{where}: event {number}: data: {DONE} before the stream's end")
            continue
        if (
            isinstance(event, dict) and "error" in event
        ):  # a failure after the 200: the error body as an event
            error = Recorded(record.method, record.path, record.template, 500, event)
            found += _validate(error, event, f"{where}: event {number}")
            continue
        found += _validate(record, event, f"{where}: event {number}")
    return found


class Recorder:
    """An httpx response hook (`client.event_hooks["response"].append(recorder)`)."""

    def __init__(self) -> None:
        self.records: list[Recorded] = []

    def __call__(self, response: httpx.Response) -> None:
        request = response.request
        template = operation_of(request.method, request.url.path)
        media_type = response.headers.get("content-type", "").partition(";")[0].strip()
        if template is None or media_type not in ("application/json", EVENT_STREAM):
            # Not an OpenAI operation, or not a JSON body nor an event stream: a file's content (the spec declares
            # a JSON string; OpenAI serves the file's bytes, as fusetune does) or a redirect to the object store.
            return
        # Read whole here; the caller still reads it (iter_lines of a stream included) from what was read.
        response.read()
        body = response.json() if media_type == "application/json" else _parse_events(response.text)
        self.records.append(
            Recorded(request.method, request.url.path, template, response.status_code, body, media_type)
        )

    def problems(self) -> list[str]:
        return [line for record in self.records for line in problems(record)]
