"""The trainer's one call into the storage layer: publish a complete checkpoint before it is recorded.

With an object store (FUSETUNE_STORAGE_URL) the checkpoint folder is uploaded, manifest last, and only then
does the reporter record it in SQL; a failed upload (after the client's retries) fails the job with the code
`storage_error`, and the checkpoints recorded before stay recorded and whole. With local storage it does
nothing: the folder the trainer renamed into place is the checkpoint.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from fusetune.config import Settings
from fusetune.storage import Storage, StorageError, open_storage
from fusetune.worker.run_storage import TENANT_ENV
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure


@functools.cache
def _storage() -> Storage:
    # The worker hands its settings to the trainer through the environment (Settings.subprocess_env).
    return open_storage(Settings())


def publish_checkpoint(folder: Path, storage_path: str) -> None:
    storage = _storage()
    if not storage.remote:
        return
    try:
        storage.publish_checkpoint(os.environ[TENANT_ENV], storage_path, folder)
    except StorageError as error:
        raise TrainingFailure(
            ErrorCode.STORAGE_ERROR, f"uploading the checkpoint {storage_path} to the store failed: {error}"
        ) from error
