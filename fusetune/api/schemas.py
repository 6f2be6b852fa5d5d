"""Request and response schemas, in the shapes of the OpenAI fine-tuning API (extra fusetune fields allowed)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Request(BaseModel):
    # A misspelt field is an error the user should see, not a setting silently ignored.
    model_config = ConfigDict(extra="forbid")


# ---- files -----------------------------------------------------------------------------------------------


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    status_details: str | None = None
    example_count: int = 0
    token_estimate: int = 0


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# ---- jobs ------------------------------------------------------------------------------------------------


class LoraHyperparameters(_Request):
    r: int = Field(default=16, ge=1, le=1024)
    alpha: float = Field(default=32.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"


class Hyperparameters(_Request):
    n_epochs: int | Literal["auto"] = "auto"
    batch_size: int | Literal["auto"] = "auto"
    learning_rate_multiplier: float | Literal["auto"] = "auto"
    learning_rate: float | None = Field(default=None, gt=0, le=1, description="Overrides base x multiplier")
    max_seq_length: int = Field(default=512, ge=16, le=131072)
    warmup_ratio: float = Field(default=0.0, ge=0, lt=1)
    lr_scheduler: Literal["cosine", "linear"] = "cosine"
    kernels: bool = Field(default=True, description="Patch the model with fusetune's Triton kernels (GPU)")
    n_gpus: int = Field(default=1, ge=1, le=64, description="Processes (GPUs) the job trains on")
    lora: LoraHyperparameters | None = Field(
        default=None, description="Train LoRA adapters instead of all weights"
    )
    merge_lora_on_save: bool = Field(default=False, description="Also save merged full weights (needs lora)")
    gradient_checkpointing: bool = False
    packing: bool = Field(
        default=False,
        description="Pack examples into rows of max_seq_length tokens (best-fit decreasing); attention stays "
        "within each example",
    )
    distributed: Literal["ddp", "fsdp"] = Field(
        default="ddp", description="fsdp shards models too big for one GPU"
    )

    @model_validator(mode="after")
    def _merge_needs_lora(self) -> Hyperparameters:
        if self.merge_lora_on_save and self.lora is None:
            raise ValueError("merge_lora_on_save needs lora")
        return self

    @field_validator("n_epochs")
    @classmethod
    def _epochs(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 100:
            raise ValueError("must be between 1 and 100")
        return value

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 4096:
            raise ValueError("must be between 1 and 4096")
        return value

    @field_validator("learning_rate_multiplier")
    @classmethod
    def _multiplier(cls, value: float | str) -> float | str:
        if isinstance(value, float | int) and not 0 < value <= 1000:
            raise ValueError("must be greater than 0 and at most 1000")
        return value


class SupervisedMethod(_Request):
    hyperparameters: Hyperparameters | None = None


class Method(_Request):
    type: Literal["supervised"] = "supervised"
    supervised: SupervisedMethod | None = None


class JobCreate(_Request):
    model: str = Field(min_length=1, max_length=255)
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(default=None, max_length=64)
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    suffix: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    metadata: dict[str, str] | None = None
    integrations: list[dict[str, Any]] | None = None
    dry_run: bool = Field(default=False, description="Create nothing; return the job's estimate instead")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if len(value) > 16:
                raise ValueError("at most 16 keys")
            for key, item in value.items():
                if len(key) > 64 or len(item) > 512:
                    raise ValueError(
                        f"key '{key[:64]}': keys are at most 64 and values at most 512 characters"
                    )
        return value

    @model_validator(mode="after")
    def _one_place_for_hyperparameters(self) -> JobCreate:
        in_method = self.method and self.method.supervised and self.method.supervised.hyperparameters
        if self.hyperparameters is not None and in_method:
            raise ValueError("give hyperparameters either at the top level or in method.supervised, not both")
        return self

    def resolved_hyperparameters(self) -> Hyperparameters:
        if self.hyperparameters is not None:
            return self.hyperparameters
        if self.method and self.method.supervised and self.method.supervised.hyperparameters:
            return self.method.supervised.hyperparameters
        return Hyperparameters()


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class JobObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    started_at: int | None = None  # fusetune: when a worker last began training it
    hyperparameters: dict[str, Any]
    method: dict[str, Any]
    model: str
    organization_id: str
    result_files: list[str] = []
    seed: int
    status: str
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    integrations: list[dict[str, Any]] | None = None
    estimated_finish: int | None = None
    metadata: dict[str, str] | None = None
    user_provided_suffix: str | None = None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobObject]
    has_more: bool


class EventObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None = None


class EventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EventObject]
    has_more: bool


class CheckpointObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, Any]
    step_number: int


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointObject]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


METRIC_VALUES_DESCRIPTION = """The step's metrics by name. Counts are over all of the job's processes.

- `train_loss`: mean cross-entropy over the step's trained tokens (those with a label).
- `learning_rate`; `grad_norm`: the gradients' global L2 norm before clipping.
- `tokens_per_second`: input tokens of the step, padding excluded, over `step_time_s`.
- `trained_tokens_per_second`: tokens with a label (the ones the loss is computed on) over `step_time_s`.
- `tokens_per_second_per_device`: `tokens_per_second` over the number of processes.
- `padding_fraction`: padding tokens over all tokens of the step's rows (each micro-batch is padded to its
  longest row); the model computes on padding too, so all tokens per second are
  `tokens_per_second / (1 - padding_fraction)`.
- `mfu` (GPUs of known peak only): `tokens_per_second_per_device` times the model's training FLOPs per token
  (6 per matmul weight, plus attention at the step's padded row length) over the peak FLOP/s that the job's
  `started` event names (`mfu_peak_flops`: the dense bf16 peak of its `device`'s spec sheet).
- `peak_memory_allocated_bytes`, `peak_memory_reserved_bytes`: the CUDA allocator's peaks during the step,
  the largest over processes (on CPU: the peak resident set size).
- `step_time_s`: wall time of the step; `epoch`: epochs done, fractional; `eta_s`: time left at the mean step
  time of the last 20 steps.
- `valid_loss`, `valid_token_accuracy`: on evaluation steps, over the validation file's trained tokens.
"""


class MetricPoint(BaseModel):
    step: int
    created_at: int
    train_loss: float | None = None
    values: dict[str, Any] = Field(description=METRIC_VALUES_DESCRIPTION)


class MetricList(BaseModel):
    object: Literal["list"] = "list"
    job_id: str
    data: list[MetricPoint]
    has_more: bool = False


class EstimateObject(BaseModel):
    object: Literal["fine_tuning.job.estimate"] = "fine_tuning.job.estimate"
    model: str
    training_tokens: int
    steps: int
    parameters: int
    peak_memory_bytes_per_gpu: int
    memory_breakdown: dict[str, int]
    gpu_memory_bytes: int | None
    fits: bool | None
    tokens_per_second: float | None
    duration_s: float | None
    throughput_source: str
