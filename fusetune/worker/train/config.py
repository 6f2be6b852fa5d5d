"""The training job's configuration: one validated tree, stored as JSON and handed to the trainer as is.

This module imports nothing heavier than pydantic so that the API and the Celery worker can build and check a
config without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fusetune.estimate import default_micro_batch_size


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraConfig(_Frozen):
    """Low-rank adapters through peft on the base model's linear layers (the base weights stay frozen)."""

    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # "all-linear": every linear layer but the output head; or module names such as ["q_proj", "v_proj"].
    target_modules: list[str] | Literal["all-linear"] = "all-linear"


class TrainConfig(_Frozen):
    # Where the job lives. `database_url=None` reports to the console instead of SQL (standalone runs, tests).
    job_id: str | None = None
    database_url: str | None = None

    # Inputs and outputs: local paths (a model id already in the local Hugging Face cache works too).
    model_path: str
    training_file: str
    validation_file: str | None = None
    output_dir: str
    # Checkpoint paths are reported relative to this directory when set (the service's runs directory), else
    # as given by output_dir.
    checkpoint_paths_relative_to: str | None = None

    # Optimisation. `batch_size` is global: sequences per optimizer step summed over all processes;
    # each process runs batch_size / (micro_batch_size * world_size) micro-batches per step. The default
    # micro-batch is the largest divisor of batch_size / world_size that keeps a micro-batch within
    # fusetune.estimate.DEFAULT_MICRO_BATCH_TOKENS tokens, so memory stays bounded whatever the batch size.
    seed: int = 0
    n_epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    batch_size: int = Field(8, ge=1)
    micro_batch_size: int | None = Field(
        None, ge=1, description="default: batch_size / world_size, capped at 16384 tokens per micro-batch"
    )
    learning_rate: float = Field(5e-5, gt=0)
    lr_scheduler: Literal["cosine", "linear"] = "cosine"
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="None: no clipping (the norm is still reported)"
    )
    max_seq_length: int = Field(2048, ge=2)

    # Data.
    packing: bool = False
    train_on_inputs: bool = Field(False, description="put the loss on every token, not only the assistant's")

    # Evaluation and checkpoints (evaluation also runs at the end of every epoch when a validation file is set).
    eval_every_steps: int | None = Field(None, ge=1)
    checkpoint_every_steps: int | None = Field(None, ge=1, description="None: only the final checkpoint")
    keep_last_checkpoints: int = Field(2, ge=1)
    # Continue from the newest checkpoint in output_dir that holds training state (a retry, a resumed pause).
    resume: bool = True

    # Model and speed.
    precision: Literal["auto", "fp32", "bf16-mixed", "bf16"] = Field(
        "auto",
        description="auto: bf16-mixed on GPU, fp32 on CPU. bf16-mixed: fp32 weights and AdamW state, bf16 "
        "compute (autocast under DDP, bf16-gathered parameters and fp32 gradient reduction under FSDP); bf16: "
        "bf16 weights and AdamW state",
    )
    kernels: bool = True
    gradient_checkpointing: bool = False
    lora: LoraConfig | None = None
    # With LoRA, checkpoints hold the adapter; this also saves the merged full weights, so that a checkpoint
    # loads with AutoModelForCausalLM.from_pretrained without the base model (the adapter moves to adapter/).
    merge_lora_on_save: bool = False

    # Parallelism over the processes torchrun starts. "ddp": a full replica per GPU; "fsdp": parameters,
    # gradients and optimizer state sharded (FSDP2, one unit per decoder layer), for models that do not fit.
    distributed: Literal["ddp", "fsdp"] = "ddp"
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
        if self.merge_lora_on_save and self.lora is None:
            raise ValueError("merge_lora_on_save needs lora: there is no adapter to merge")
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
