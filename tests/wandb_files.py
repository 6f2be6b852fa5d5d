"""Reading back what `wandb` wrote for an offline run: its transaction log (`run-<id>.wandb`, LevelDB's log
format of `wandb_internal_pb2.Record`s after a 7-byte header) and its files."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK_BYTES = 32 * 1024
FILE_HEADER_BYTES = 7  # ":W&B", a 2-byte magic, a version byte
RECORD_HEADER_BYTES = 7  # crc32, length, fragment type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, pending = FILE_HEADER_BYTES, b""
    while position + RECORD_HEADER_BYTES <= len(data):
        left_in_block = BLOCK_BYTES - position % BLOCK_BYTES
        if left_in_block < RECORD_HEADER_BYTES:  # the block's tail is padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + RECORD_HEADER_BYTES])
        start = position + RECORD_HEADER_BYTES
        pending += data[start : start + length]
        position = start + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@dataclass
class WandbRun:
    run_id: str = ""
    project: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int | None = None
    folder: Path | None = None

    def table(self, key: str) -> dict[str, Any]:
        """A wandb.Table logged under `key`, as its JSON file."""
        row = next(h for h in reversed(self.history) if f"{key}/path" in h)
        return json.loads((self.folder / "files" / row[f"{key}/path"]).read_text())


def read_offline_run(folder: Path) -> WandbRun:
    """The run an `offline-run-*` folder holds, from its transaction log."""
    run = WandbRun(folder=folder)
    (log,) = folder.glob("run-*.wandb")
    for record in records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project, run.name = record.run.run_id, record.run.project, record.run.display_name
            run.tags = list(record.run.tags)
            run.config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            run.config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            run.history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run
