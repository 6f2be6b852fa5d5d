"""Writes openapi.subset.json: the operations of OpenAI's OpenAPI description that fusetune serves, with every
component schema they reach and ErrorResponse.

The full description (openapi.yaml of github.com/openai/openai-openapi) is about 3 MB; the conformance test
(tests/api/test_openai_conformance.py) needs the files, fine-tuning, graders and models operations only. The
subset keeps those path items and schemas unchanged (their examples included), so a $ref in it resolves as in
the full file. Run it on a newer openapi.yaml to move the vendored subset, and update README.md's version line:

    python tests/data/openai_openapi/extract.py path/to/openapi.yaml
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent
OUTPUT = HERE / "openapi.subset.json"

PATHS = (
    "/files",
    "/files/{file_id}",
    "/files/{file_id}/content",
    "/fine_tuning/alpha/graders/run",
    "/fine_tuning/alpha/graders/validate",
    "/fine_tuning/jobs",
    "/fine_tuning/jobs/{fine_tuning_job_id}",
    "/fine_tuning/jobs/{fine_tuning_job_id}/cancel",
    "/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints",
    "/fine_tuning/jobs/{fine_tuning_job_id}/events",
    "/fine_tuning/jobs/{fine_tuning_job_id}/pause",
    "/fine_tuning/jobs/{fine_tuning_job_id}/resume",
    "/models",
    "/models/{model}",
)
# Every error body, whatever the operation: the spec's operations declare only their success responses.
ALSO = ("ErrorResponse",)
PREFIX = "#/components/schemas/"


def _refs(node: object) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node)) if node else set()
    return set()


def subset(spec: dict) -> dict:
    paths = {path: spec["paths"][path] for path in PATHS}
    schemas = spec["components"]["schemas"]
    wanted: set[str] = set(ALSO)
    pending = [ref.removeprefix(PREFIX) for ref in _refs(paths)] + list(ALSO)
    while pending:
        name = pending.pop()
        wanted.add(name)
        for ref in _refs(schemas[name]):
            if not ref.startswith(PREFIX):
                raise ValueError(f"{name}: a $ref outside the component schemas ({ref})")
            if (child := ref.removeprefix(PREFIX)) not in wanted:
                pending.append(child)
    return {
        "openapi": spec["openapi"],
        "info": spec["info"],
        "servers": spec["servers"],
        "paths": paths,
        "components": {"schemas": {name: schemas[name] for name in sorted(wanted)}},
    }


def main(source: str) -> None:
    spec = yaml.safe_load(Path(source).read_text())
    OUTPUT.write_text(json.dumps(subset(spec), indent=1, ensure_ascii=False) + "\n")
    print(f"{OUTPUT}: {len(PATHS)} paths, spec version {spec['info']['version']}")


if __name__ == "__main__":
    main(sys.argv[1])
