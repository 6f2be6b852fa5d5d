"""A run's local scratch, so that a worker needs no disk shared with any other host: the job's inputs copied
in before the run, and the scratch cleared after it. Checkpoints in the store are the checkpoints package's
(`fusetune.worker.train.checkpoints.store`).

With local storage (one host) every step is a no-op or hands back the file in place.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fusetune.storage import Storage
from fusetune.worker.train.checkpoints.layout import checkpoints_root

INPUTS_DIRNAME = "inputs"


def stage_input(storage: Storage, tenant: str, storage_name: str, run_dir: Path) -> Path:
    """A local path of one of the job's files: in place (local storage) or copied into the run's scratch."""
    return storage.fetch_file(tenant, storage_name, run_dir / INPUTS_DIRNAME)


def clear_scratch(storage: Storage, run_dir: Path) -> None:
    """With a remote store the local copies are scratch: the store holds what the next run needs."""
    if storage.remote:
        for path in (run_dir / INPUTS_DIRNAME, checkpoints_root(run_dir)):
            shutil.rmtree(path, ignore_errors=True)
