"""Writes openapi.subset.json: the operations of OpenAI's OpenAPI description that fusetune serves, with every
component (schema, shared response) they reach and ErrorResponse.

The full description (openapi.yaml of github.com/openai/openai-openapi) is about 3 MB; the conformance test
(tests/api/test_openai_conformance.py) needs the files, fine-tuning, graders, models, chat completions and evals
operations only. The subset keeps those operations and components unchanged (their examples included), so a
$ref in it resolves as in the full file; of a path item whose other operations fusetune does not serve (the
stored chat completions' GET /chat/completions) it keeps the served ones. Run it on a newer openapi.yaml to move the vendored subset, and update README.md's version line:

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
    "/chat/completions",
    "/evals",
    "/evals/{eval_id}",
    "/evals/{eval_id}/runs",
    "/evals/{eval_id}/runs/{run_id}",
    "/evals/{eval_id}/runs/{run_id}/output_items",
    "/evals/{eval_id}/runs/{run_id}/output_items/{output_item_id}",
)
# The operations of a path above that fusetune does not serve, left out with what only they reach: listing,
# reading and deleting stored chat completions (fusetune stores none).
NOT_SERVED = {"/chat/completions": ("get",)}
# Every error body, whatever the operation: the spec's operations declare only their success responses.
ALSO = ("#/components/schemas/ErrorResponse",)
PREFIX = "#/components/"


def _refs(node: object) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node)) if node else set()
    return set()


def _component(spec: dict, ref: str) -> tuple[str, str]:
    """(kind, name) of a component $ref such as #/components/schemas/Eval or #/components/responses/..."""
    if not ref.startswith(PREFIX) or ref.count("/") != 3:
        raise ValueError(f"a $ref to something other than a component ({ref})")
    kind, name = ref.removeprefix(PREFIX).split("/")
    if name not in spec["components"].get(kind, {}):
        raise ValueError(f"{ref}: no such component")
    return kind, name


def subset(spec: dict) -> dict:
    paths = {
        path: {
            key: value for key, value in spec["paths"][path].items() if key not in NOT_SERVED.get(path, ())
        }
        for path in PATHS
    }
    wanted: set[tuple[str, str]] = set()
    pending = [_component(spec, ref) for ref in _refs(paths) | set(ALSO)]
    while pending:
        kind, name = pending.pop()
        if (kind, name) in wanted:
            continue
        wanted.add((kind, name))
        pending.extend(_component(spec, ref) for ref in _refs(spec["components"][kind][name]))
    components: dict[str, dict] = {}
    for kind, name in sorted(wanted):
        components.setdefault(kind, {})[name] = spec["components"][kind][name]
    return {
        "openapi": spec["openapi"],
        "info": spec["info"],
        "servers": spec["servers"],
        "paths": paths,
        "components": components,
    }


def main(source: str) -> None:
    spec = yaml.safe_load(Path(source).read_text())
    OUTPUT.write_text(json.dumps(subset(spec), indent=1, ensure_ascii=False) + "\n")
    print(f"{OUTPUT}: {len(PATHS)} paths, spec version {spec['info']['version']}")


if __name__ == "__main__":
    main(sys.argv[1])
