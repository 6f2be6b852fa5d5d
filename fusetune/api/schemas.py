"""Request and response schemas, in the shapes of the OpenAI fine-tuning API (extra fusetune fields allowed)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fusetune.spec.hyperparameters import HyperparametersRequest
from fusetune.spec.integrations import Integrations
from fusetune.spec.methods import DEFAULT_METHOD, MethodRequest
from fusetune.spec.plan import MemoryPlan


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
    # OpenAI's schema declares a string: left out when there is nothing to say, never null.
    status_details: str | None = Field(default=None, exclude_if=lambda value: value is None)
    example_count: int = 0
    token_estimate: int = 0
    # The training method (`method.type` of a job) whose examples the file holds.
    method: str = DEFAULT_METHOD


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = Field(description="the page's first file; null when the page is empty")
    last_id: str | None = Field(
        description="the page's last file, the `after` of the next page; null when the page is empty"
    )
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# ---- models ----------------------------------------------------------------------------------------------


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True


# ---- jobs ------------------------------------------------------------------------------------------------


# The hyperparameters, the methods and their settings, with every default and bound, are the job
# specification's (fusetune/spec/); a request's `method` is derived from its method table.


class JobCreate(_Request):
    model: str = Field(min_length=1, max_length=255)
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(default=None, max_length=64)
    hyperparameters: HyperparametersRequest | None = None
    method: MethodRequest | None = None
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    suffix: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    metadata: dict[str, str] | None = None
    integrations: Integrations | None = Field(
        default=None,
        description='Also report the run to Weights & Biases ({"type": "wandb", "wandb": {"project", "name", '
        '"entity", "tags"}}) or an MLflow tracking server ({"type": "mlflow", "mlflow": {"tracking_uri", '
        '"experiment_name", "run_name", "tags"}})',
    )
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


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class JobAttemptObject(BaseModel):
    """fusetune: one start of the job by a worker."""

    number: int
    started_at: int
    ended_at: int | None = None
    cause: str | None = Field(
        default=None,
        description="How the attempt ended: succeeded, failed, cancelled, paused, handed_over (its worker was "
        "stopped and gave the job back with a checkpoint), worker_lost or crashed; null while it runs",
    )
    fault: bool = Field(
        default=False,
        description="worker_lost or crashed: only faults count against the server's retry limit",
    )


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
    result_files: list[str] = Field(
        default=[],
        description="Once the job succeeded: the id of its results file, a CSV of every step's metrics (step, "
        "train_loss, train_mean_token_accuracy, valid_loss, valid_mean_token_accuracy, then the method's own)",
    )
    seed: int
    status: str
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    integrations: list[dict[str, Any]] | None = None
    estimated_finish: int | None = Field(
        default=None, description="While the job runs: when it should end, at its recent measured step time"
    )
    metadata: dict[str, str] | None = None
    user_provided_suffix: str | None = None
    # fusetune: every start of the job with how it ended, and the time it trained over all of them.
    attempts: list[JobAttemptObject] = []
    training_seconds: int | None = None
    status_details: str | None = Field(
        default=None, description="Why a queued job is not training yet (no worker, its tenant's limit, ...)"
    )
    resolved: dict[str, Any] | None = Field(
        default=None,
        description="What the job's latest start ran with, as its trainer resolved it: precision, optimizer, "
        "kernels, micro_batch_size, grad_accum_steps, gradient_checkpointing, distributed, world_size (nodes x "
        "processes_per_node), device, "
        "memory_plan (and its description); null until training started. hyperparameters.precision, .kernels "
        "and the memory plan's parts then report the same values.",
    )


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobObject]
    has_more: bool


# OpenAI's event levels. The trainer and the worker record Python's "warning"; an event is read out in OpenAI's
# word (api_event_level), whenever it was stored.
EventLevel = Literal["info", "warn", "error"]
_STORED_EVENT_LEVELS: dict[str, EventLevel] = {
    "info": "info",
    "warning": "warn",
    "warn": "warn",
    "error": "error",
}


def api_event_level(stored: str) -> EventLevel:
    """The API's level of a stored event's level; anything unknown (say "debug") reads as info."""
    return _STORED_EVENT_LEVELS.get(stored, "info")


class EventObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: EventLevel
    message: str
    type: str
    data: dict[str, Any] = Field(default={}, description="the event's details; {} when it has none")


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
    metrics: dict[str, Any] = Field(
        description="step, train_loss (and the method's training metrics of that step), and when the job has a "
        "validation file valid_loss, valid_mean_token_accuracy (or the method's valid_ metrics) with their "
        "full_valid_ copies: all over the whole validation file at that step"
    )
    step_number: int
    best: bool = Field(
        default=False,
        description="fusetune: the checkpoint of the best evaluation of a job that stopped early (its model)",
    )


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
  (6 per matmul weight, plus attention over the length of the example each token belongs to, averaged over
  the step's tokens) over the peak FLOP/s that the job's `started` event names (`mfu_peak_flops`: the dense
  bf16 peak of its `device`'s spec sheet).
- `peak_memory_allocated_bytes`, `peak_memory_reserved_bytes`: the CUDA allocator's peaks during the step,
  the largest over processes (on CPU: the peak resident set size).
- `step_time_s`: wall time of the step; `epoch`: epochs done, fractional; `eta_s`: time left at the mean step
  time of the last 20 steps; `trained_tokens`: input tokens trained on so far (the job's `trained_tokens`).
- `train_mean_token_accuracy` (supervised): the share of the step's trained tokens that the model predicts
  exactly (its argmax; the fused loss kernel counts them without building the logits).
- `valid_loss`, `valid_mean_token_accuracy`: on evaluation steps (each epoch's end, each checkpoint,
  `eval_every_steps`), over the validation file's trained tokens; preference methods report `valid_loss` and
  `valid_` versions of their reward metrics.
"""


class RankMemory(BaseModel):
    """One rank's memory peaks of a step (the step's values hold the maximum over ranks)."""

    rank: int
    node: int = Field(description="The node's index in the job (0 holds rank 0)")
    host: str
    peak_memory_allocated_bytes: float
    peak_memory_reserved_bytes: float


class MetricPoint(BaseModel):
    step: int
    created_at: int
    train_loss: float | None = None
    values: dict[str, Any] = Field(description=METRIC_VALUES_DESCRIPTION)
    rank_memory: list[RankMemory] | None = Field(
        None, description="Each rank's memory peaks of the step, with its node and host; null in older steps"
    )


class MetricList(BaseModel):
    object: Literal["list"] = "list"
    job_id: str
    data: list[MetricPoint]
    has_more: bool = False


class DataCheckSegment(BaseModel):
    text: str
    trained: bool


class DataCheckSequence(BaseModel):
    label: str = Field(
        description='"example", or a preference pair\'s "preferred_output" / "non_preferred_output"'
    )
    tokens: int
    trained_tokens: int
    segments: list[DataCheckSegment] = Field(
        description="the sequence as the model sees it (the chat template applied), in stretches that are trained "
        "or not; a long stretch keeps its start and its end"
    )


class DataCheckPreview(BaseModel):
    file: str
    line: int
    sequences: list[DataCheckSequence]
    marked_text: str = Field(description="the same, trained stretches between ⟦ and ⟧")


class DataCheckFailureObject(BaseModel):
    check: str = Field(description="the check that failed (see data_check.checks)")
    file: str
    param: str = Field(description="training_file or validation_file")
    line: int
    problem: str = Field(description="what is wrong with the example")
    message: str = Field(description="the 400's message: where, the check, the problem, the example marked")


class DataCheckFile(BaseModel):
    file: str
    param: str
    examples_checked: int
    all_examples_checked: bool = Field(description="false when only the first examples were checked")
    examples_truncated: int = Field(description="of those checked, examples longer than max_seq_length")
    examples_without_trained_tokens: int = Field(
        description="of those checked, examples max_seq_length cuts to no trained token (the trainer leaves them out)"
    )


class DataCheckObject(BaseModel):
    """The job's files tokenized and masked as the trainer will (fusetune/tokenization/check.py)."""

    status: Literal["passed", "failed", "not_checked"]
    reason: str | None = Field(default=None, description="why the data was not checked here")
    checks: dict[str, str] = Field(default={}, description="each check run, by name, with what it holds to")
    stop_tokens: list[str] = Field(default=[], description="the tokens that stop the model's generation")
    files: list[DataCheckFile] = []
    failure: DataCheckFailureObject | None = None
    preview: DataCheckPreview | None = Field(
        default=None, description="the failing example, else the training file's first"
    )


class PlanAlternative(BaseModel):
    change: str = Field(description='what to change, e.g. "n_gpus 2 and distributed fsdp"')
    hyperparameters: dict[str, Any] = Field(description="the changed hyperparameters, as a request sends")
    plan: MemoryPlan
    plan_description: str
    peak_memory_bytes_per_gpu: int


class EstimateObject(BaseModel):
    object: Literal["fine_tuning.job.estimate"] = "fine_tuning.job.estimate"
    model: str
    training_tokens: int
    steps: int
    parameters: int
    micro_batch_size: int = Field(
        description="sequences per forward on one GPU: the plan's (the worker plans again from the memory free "
        "when the job starts)"
    )
    plan: MemoryPlan = Field(
        description="the memory plan: the fastest that fits gpu_memory_bytes when the server knows it (its pins "
        "kept), else the job's settings and the defaults; when nothing fits, the plan of least memory"
    )
    plan_description: str
    peak_memory_bytes_per_gpu: int = Field(description="the plan's estimated peak on each GPU")
    memory_breakdown: dict[str, int]
    host_activation_bytes: int = Field(description="pinned host memory per GPU of offloaded activations")
    host_optimizer_state_bytes: int = Field(
        0, description="pinned host memory per GPU of the optimizer's state, with optimizer_state_on_host"
    )
    gpu_memory_bytes: int | None = Field(
        description="memory of the GPU the job would land on (FUSETUNE_GPU_MEMORY_BYTES); null: not known"
    )
    fits: bool | None
    alternatives: list[PlanAlternative] | None = Field(
        default=None,
        description="when no plan fits: changes under which one does (more GPUs with fsdp, LoRA, a shorter "
        "max_seq_length, kernels on), each with its plan and peak",
    )
    remedies: dict[str, int] | None = Field(
        default=None, description="the alternatives' changes with their peaks per GPU (alternatives in short)"
    )
    refusal: str | None = Field(default=None, description="why creating the job would be refused")
    checkpoint_bytes: int = Field(description="one checkpoint: weights and the plan's optimizer state")
    checkpoints_on_disk: int = Field(
        description="keep_last_checkpoints + the next one being written; 1 (the final one) when the job saves none "
        "before its end"
    )
    checkpoint_disk_bytes: int = Field(description="checkpoint_bytes x checkpoints_on_disk")
    disk_free_bytes: int | None = Field(description="free space of the server's data directory")
    disk_fits: bool | None
    tokens_per_second: float | None
    duration_s: float | None
    throughput_source: str
    data_check: DataCheckObject | None = Field(
        default=None,
        description="the data check of the job's files: creating the job is refused when it fails",
    )
