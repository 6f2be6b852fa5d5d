"""Where a model a tenant names is on this worker: a base model's folder (or cached hub id), or a fine-tuned
model's checkpoint restored from the store, and the bases a LoRA checkpoint stands on. Training (tasks.py) and
chat completions (fusetune.serving) both load models from what this answers."""

from __future__ import annotations

from fusetune.catalog import base_model_location
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.storage import Storage
from fusetune.worker.train.checkpoints import store as checkpoint_store
from fusetune.worker.train.checkpoints.layout import adapter_base_model_name


class ModelLocations:
    def __init__(self, settings: Settings, session_factory, storage: Storage):
        self.settings = settings
        self.session_factory = session_factory
        self.storage = storage

    def location_of(self, model: str, tenant: str) -> str | None:
        """A base model's location, or the local folder of the tenant's fine-tuned model's newest checkpoint (or
        of the one a checkpoint's model name names); None for a model the tenant cannot use."""
        location = base_model_location(self.settings, model)
        if location is not None:
            return location
        with self.session_factory() as session:
            checkpoint = queries.checkpoint_of_model(session, model, tenant)
            if checkpoint is not None:
                return str(checkpoint_store.restore_model(
                    self.storage, tenant, checkpoint.storage_path, self.settings.runs_dir
                ).resolve())  # fmt: skip
        return None

    def adapter_base_models(self, tenant: str, location: str) -> dict[str, str]:
        """Where the base model of a LoRA checkpoint at `location` is here, by the public name the checkpoint
        gives it, and so on down while a base is a LoRA checkpoint too (TrainConfig.adapter_base_models). A name
        this server does not know (an older checkpoint's path) is left to the loader to load as it is."""
        found: dict[str, str] = {}
        while (name := adapter_base_model_name(location)) is not None and name not in found:
            base = self.location_of(name, tenant)
            if base is None:
                break
            found[name] = location = base
        return found
