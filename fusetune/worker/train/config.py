"""The training job's configuration: one validated tree, stored as JSON and handed to the trainer as is.

Its training fields and their defaults are the job specification's (fusetune/spec/); this module adds the
run's paths and the settings a service job does not choose. It imports nothing heavier than pydantic so that
the Celery worker can build and check a config without importing torch.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from fusetune.config import Settings
from fusetune.spec.estimate import default_micro_batch_size
from fusetune.spec.hyperparameters import DEFAULT_N_EPOCHS, TrainingHyperparameters
from fusetune.spec.integrations import Integrations
from fusetune.spec.methods import MethodSpec, method_spec

_SERVICE = Settings.model_fields


class TrainConfig(TrainingHyperparameters):
    """The trainer's configuration: a job's training hyperparameters (fusetune/spec/, defaults there) plus
    where the run lives and settings the service does not offer per job."""

    method: MethodSpec = Field(default_factory=method_spec)
    # A job is held to the service's limits (at most 100 epochs, a learning rate of at most 1); a run of the
    # trainer itself, a test's or a benchmark's, is not: it may run until it is cancelled, or provoke a
    # non-finite step.
    n_epochs: int = Field(DEFAULT_N_EPOCHS, ge=1)
    learning_rate: float = Field(TrainingHyperparameters.model_fields["learning_rate"].default, gt=0)

    # Where the job lives. `database_url=None` reports to the console instead of SQL (standalone runs, tests).
    job_id: str | None = None
    database_url: str | None = None
    # Where rank 0 also reports the run (fusetune/spec/integrations.py, worker/train/tracking.py): the job's
    # integrations, and the server's MLflow tracking server for every job (FUSETUNE_MLFLOW_TRACKING_URI).
    integrations: Integrations = Field(default_factory=list)
    mlflow_tracking_uri: str | None = None

    # Inputs and outputs: local paths (a model id already in the local Hugging Face cache works too).
    model_path: str
    # The model's public name (the job's `model`: a base model's name or Hugging Face id, a fine-tuned model's
    # name), which a LoRA checkpoint names as its base model in place of model_path, a path of the server's that
    # the tenant must not see and that exists only there. None: model_path (a run of the trainer itself).
    model_name: str | None = None
    # Where the base models that LoRA checkpoints name are on this host, by public name: model_path's, if it is
    # one, and so on down (a fine-tuned model's base can be a LoRA checkpoint too). The worker fills it in.
    adapter_base_models: dict[str, str] = Field(default_factory=dict)
    training_file: str
    validation_file: str | None = None
    output_dir: str
    # Checkpoint paths are reported relative to this directory when set (the service's runs directory), else
    # as given by output_dir.
    checkpoint_paths_relative_to: str | None = None

    # Optimisation. `batch_size` is global: sequences per optimizer step summed over all processes;
    # each process runs batch_size / (micro_batch_size * world_size) micro-batches per step. The default
    # micro-batch is the largest divisor of batch_size / world_size that keeps a micro-batch within
    # fusetune.spec.estimate.DEFAULT_MICRO_BATCH_TOKENS tokens, so memory stays bounded whatever the batch size.
    seed: int = 0
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    micro_batch_size: int | None = Field(
        None, ge=1, description="default: batch_size / world_size, capped at 16384 tokens per micro-batch"
    )
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="None: no clipping (the norm is still reported)"
    )
    train_on_inputs: bool = Field(False, description="put the loss on every token, not only the assistant's")

    # Checkpoints (evaluation, eval_every_steps, is the job specification's).
    # Resumable checkpoints before the final one (see checkpoints/schedule.py): a crashed run resumes from
    # the newest. The defaults are the service's (fusetune.config.Settings, where 0 means none).
    checkpoint_every_steps: int | None = Field(
        _SERVICE["checkpoint_every_steps"].default or None,
        ge=1,
        description="None: no step-count checkpoints",
    )
    checkpoint_every_epoch: bool = _SERVICE["checkpoint_every_epoch"].default
    checkpoint_every_minutes: float | None = Field(
        _SERVICE["checkpoint_every_minutes"].default or None,
        gt=0,
        description="of training since the last checkpoint; None: no time-based checkpoints",
    )
    keep_last_checkpoints: int = Field(_SERVICE["keep_last_checkpoints"].default, ge=1)
    # Continue from the newest checkpoint in output_dir that holds training state (a retry, a resumed pause).
    resume: bool = True

    # The memory of one GPU the run may use (the service's gpu_memory_bytes, which the API's estimates use): each
    # process is capped at it and the memory plan fits it, on a card that has more. None: the card's free memory.
    gpu_memory_bytes: int | None = Field(_SERVICE["gpu_memory_bytes"].default, ge=1)

    # DDP's gradient buckets (a tuning knob for benchmarks/scaling/gpus.py).
    ddp_bucket_cap_mb: int | None = Field(
        None, ge=1, description="DDP gradient bucket size; default chosen in the trainer for overlap"
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        if self.micro_batch_size is not None:
            if self.micro_batch_size > self.batch_size or self.batch_size % self.micro_batch_size:
                raise ValueError(
                    f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size "
                    f"({self.micro_batch_size})"
                )
        return self

    def micro_batches_per_rank(self, world_size: int) -> tuple[int, int]:
        """(micro_batch_size, micro-batches per process per step) for `world_size` processes."""
        micro = self.micro_batch_size
        if micro is None and self.batch_size % world_size == 0:
            micro = default_micro_batch_size(self.batch_size // world_size, self.max_seq_length)
        micro = micro or self.batch_size // world_size
        if micro < 1 or self.batch_size % (micro * world_size):
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size ({micro or 1}) times "
                f"the number of processes ({world_size})"
            )
        return micro, self.batch_size // (micro * world_size)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> TrainConfig:
        return cls.model_validate_json(text)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    @classmethod
    def read(cls, path: str | Path) -> TrainConfig:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))
