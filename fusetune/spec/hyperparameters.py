"""A job's hyperparameters: what a client may send, and every value decided.

- `TrainingHyperparameters`: what a job trains with; the base of the trainer's `TrainConfig`, so the values the
  job row stores reach the trainer as they are.
- `JobHyperparameters`: those plus what the service decides around the training (`n_gpus`, the learning rate's
  multiplier), as the row stores them and the API reports them.
- `HyperparametersRequest`: what a client may send, "auto" allowed where the OpenAI API allows it. Its bounds
  are `JobHyperparameters`'s, checked by `within_bounds`, not restated.

Every default and every bound is written here once.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fusetune.spec.precision import AUTO, PRECISION_NAMES

DEFAULT_N_EPOCHS = 3
# The most sequences per step "auto" picks; fewer when the training file has fewer examples.
DEFAULT_BATCH_SIZE = 8
DEFAULT_LEARNING_RATE_MULTIPLIER = 1.0
# The learning rate a multiplier of 1 means (FUSETUNE_BASE_LEARNING_RATE overrides it on a server).
DEFAULT_BASE_LEARNING_RATE = 1e-4

PrecisionName = Literal[PRECISION_NAMES]  # type: ignore[valid-type]
# The longest sequence a job may train on, in tokens.
MAX_SEQ_LENGTH = 131072


class SpecError(ValueError):
    """A combination of values that cannot run; `field` names the request's field to change
    ("hyperparameters.batch_size")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# A misspelt field is an error the user should see, not a setting silently ignored; `true` or "3" is not a
# number of epochs, and NaN no learning rate: nothing is coerced, and a non-finite float is refused as such.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Spec(BaseModel):
    model_config = ConfigDict(**STRICT, frozen=True)


@cache
def _field_checker(model: type[BaseModel], name: str) -> TypeAdapter:
    field = model.model_fields[name]
    # Annotated needs at least one annotation: a field without bounds (a Literal) is checked by its type alone.
    checked = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
    return TypeAdapter(checked, config=ConfigDict(strict=True, allow_inf_nan=False))


def within_bounds(model: type[BaseModel], name: str, value: Any) -> Any:
    """`value` checked against field `name` of `model` (its type and bounds); "auto" passes as it is. Raises
    ValueError with pydantic's message ("Input should be less than or equal to 100")."""
    if value == AUTO:
        return value
    try:
        return _field_checker(model, name).validate_python(value)
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"]) from None


class LoraSpec(Spec):
    """Low-rank adapters through peft on the base model's linear layers (the base weights stay frozen)."""

    r: int = Field(16, ge=1, le=1024, description="Rank of the adapters")
    alpha: float = Field(32.0, gt=0, description="Scale of the adapters' update: alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input")
    # At least one name, none empty: peft would build no adapter, and the job would train nothing.
    target_modules: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | Literal["all-linear"]
    ) = Field(
        "all-linear",
        description='"all-linear": every linear layer but the output head; or module names such as '
        '["q_proj", "v_proj"]',
    )

    def unmatched_targets(self, module_paths: set[str]) -> list[str]:
        """The names in target_modules that match none of `module_paths` as peft matches them: a module's whole
        path, or its end after a dot ("q_proj", "self_attn.q_proj"). None unmatched for "all-linear"."""
        if self.target_modules == "all-linear":
            return []
        return [
            target
            for target in self.target_modules
            if target not in module_paths and not any(path.endswith(f".{target}") for path in module_paths)
        ]


class EarlyStoppingSpec(Spec):
    """Stop training once the validation loss has not improved for `patience` evaluations in a row. The job
    still succeeds; its fine-tuned model is the checkpoint of its best evaluation (fusetune's own field: the
    OpenAI API has none)."""

    patience: int = Field(
        3, ge=1, le=1000, description="Evaluations in a row without improvement after which training stops"
    )
    min_delta: float = Field(
        0.0,
        ge=0,
        description="How much lower than the best so far a validation loss must be to count as better",
    )


class TrainingHyperparameters(Spec):
    """What a job trains with, every value decided."""

    n_epochs: int = Field(DEFAULT_N_EPOCHS, ge=1, le=100)
    batch_size: int = Field(
        DEFAULT_BATCH_SIZE, ge=1, le=4096, description="sequences per optimizer step, all GPUs"
    )
    learning_rate: float = Field(DEFAULT_BASE_LEARNING_RATE * DEFAULT_LEARNING_RATE_MULTIPLIER, gt=0, le=1)
    lr_scheduler: Literal["cosine", "linear"] = "cosine"
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    max_seq_length: int = Field(512, ge=16, le=MAX_SEQ_LENGTH)
    packing: bool = Field(
        False,
        description="Pack examples into rows of max_seq_length tokens (best-fit decreasing); attention stays "
        "within each example",
    )
    precision: PrecisionName = Field(
        AUTO,
        description="auto (the device's default), or one of the precision modes; GET /v1/fine_tuning/options "
        "describes each",
    )
    kernels: bool = Field(True, description="Patch the model with fusetune's Triton kernels (GPU)")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute every decoder layer in the backward: recompute_layers set to the model's layer "
        "count (a recompute_layers given with it must be that count)",
    )
    # The memory plan (fusetune/spec/plan.py). None leaves that part to the planner, which picks the fastest plan
    # that fits the GPU the job lands on; the trainer runs with every part decided.
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Sequences per forward on each GPU; gradient accumulation makes up the rest of batch_size / "
        "n_gpus, which it must divide (null: the planner decides)",
    )
    recompute_layers: int | None = Field(
        None,
        ge=0,
        description="Decoder layers whose activations are recomputed in the backward instead of kept, the "
        "cheapest to recompute first (null: the planner decides)",
    )
    offload_layers: int | None = Field(
        None,
        ge=0,
        description="Decoder layers whose saved activations wait in pinned host memory until the backward "
        "(null: the planner decides)",
    )
    optimizer_in_backward: bool | None = Field(
        None,
        description="Update each parameter as soon as its gradient is complete and free that gradient, so all "
        "gradients never exist at once; steps without gradient accumulation only (null: the planner decides)",
    )
    optimizer_state_on_host: bool | None = Field(
        None,
        description="Keep the optimizer's state in host memory and copy each parameter's to the GPU for its "
        "update: the state costs no GPU memory but crosses the host link twice a step; bf16-sr and "
        "bf16-sr-8bit's optimizers, not with distributed fsdp (null: the planner decides)",
    )
    lora: LoraSpec | None = Field(None, description="Train LoRA adapters instead of all weights")
    # With LoRA, checkpoints hold the adapter; this also saves the merged full weights, so that a checkpoint
    # loads with AutoModelForCausalLM.from_pretrained without the base model (the adapter moves to adapter/).
    merge_lora_on_save: bool = Field(False, description="Also save merged full weights (needs lora)")
    # "ddp": a full replica per GPU; "fsdp": parameters, gradients and optimizer state sharded (FSDP2, one unit
    # per decoder layer), for models that do not fit.
    distributed: Literal["ddp", "fsdp"] = Field("ddp", description="fsdp shards models too big for one GPU")
    # Evaluation on the validation file runs at the end of every epoch, at every checkpoint, and every
    # eval_every_steps steps when set; early stopping counts those evaluations.
    eval_every_steps: int | None = Field(
        None, ge=1, description="Also evaluate on the validation file every this many steps"
    )
    early_stopping: EarlyStoppingSpec | None = Field(
        None,
        description="Stop once the validation loss stops improving (needs a validation_file); null: train to "
        "the end",
    )

    @model_validator(mode="after")
    def _merge_needs_lora(self) -> TrainingHyperparameters:
        if self.merge_lora_on_save and self.lora is None:
            raise ValueError("merge_lora_on_save needs lora: there is no adapter to merge")
        return self

    def training_fields(self) -> dict[str, Any]:
        """The values `TrainConfig` takes over (the fields of this class)."""
        return {name: getattr(self, name) for name in TrainingHyperparameters.model_fields}


class JobHyperparameters(TrainingHyperparameters):
    """A job's hyperparameters as its row stores them and the API reports them."""

    # No upper bound of its own: a multiplier too large shows as a learning rate above learning_rate's bound.
    learning_rate_multiplier: float = Field(DEFAULT_LEARNING_RATE_MULTIPLIER, gt=0)
    n_gpus: int = Field(1, ge=1, le=64, description="Processes (GPUs) the job trains on")


# Fields a client may leave to the service, as the OpenAI API allows (micro_batch_size: to the memory planner).
AUTO_FIELDS = ("n_epochs", "batch_size", "learning_rate_multiplier", "micro_batch_size")


class HyperparametersRequest(JobHyperparameters):
    """Hyperparameters as a client sends them; "auto" (the default) is decided by `resolve`."""

    model_config = ConfigDict(**STRICT, frozen=False)

    n_epochs: int | Literal["auto"] = "auto"  # type: ignore[assignment]
    batch_size: int | Literal["auto"] = "auto"  # type: ignore[assignment]
    learning_rate_multiplier: float | Literal["auto"] = "auto"  # type: ignore[assignment]
    micro_batch_size: int | Literal["auto"] | None = "auto"  # type: ignore[assignment]
    learning_rate: float | None = Field(  # type: ignore[assignment]
        None, description="Overrides the server's base learning rate x learning_rate_multiplier"
    )

    @field_validator(*AUTO_FIELDS, "learning_rate")
    @classmethod
    def _within_bounds(cls, value: Any, info: ValidationInfo) -> Any:
        return value if value is None else within_bounds(JobHyperparameters, info.field_name, value)

    @model_validator(mode="after")
    def _one_learning_rate(self) -> HyperparametersRequest:
        if self.learning_rate is not None and self.learning_rate_multiplier != AUTO:
            raise ValueError(
                "give learning_rate or learning_rate_multiplier, not both: learning_rate replaces the base "
                "learning rate times the multiplier"
            )
        return self

    def resolve(self, example_count: int, base_learning_rate: float) -> JobHyperparameters:
        """Every "auto" decided, so that the job row says exactly what will run. Raises SpecError for a
        combination no trainer can run."""
        values = self.model_dump(include=set(JobHyperparameters.model_fields))
        if values["n_epochs"] == AUTO:
            values["n_epochs"] = DEFAULT_N_EPOCHS
        n_gpus = values["n_gpus"]
        if values["batch_size"] == AUTO:
            # Every process gets the same number of sequences per step.
            values["batch_size"] = max(1, min(DEFAULT_BATCH_SIZE, example_count) // n_gpus) * n_gpus
        elif values["batch_size"] % n_gpus:
            raise SpecError(
                "hyperparameters.batch_size",
                f"hyperparameters.batch_size ({values['batch_size']}) must be a multiple of "
                f"hyperparameters.n_gpus ({n_gpus}).",
            )
        _check_memory_plan_pins(values)
        if values["learning_rate"] is None:
            if values["learning_rate_multiplier"] == AUTO:
                values["learning_rate_multiplier"] = DEFAULT_LEARNING_RATE_MULTIPLIER
            values["learning_rate"] = base_learning_rate * values["learning_rate_multiplier"]
        else:
            # The multiplier the job reports is the one its learning rate amounts to.
            values["learning_rate_multiplier"] = values["learning_rate"] / base_learning_rate
        try:
            return JobHyperparameters(**values)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise SpecError(
                str(error["loc"][0]), f"hyperparameters.{error['loc'][0]}: {error['msg']}"
            ) from None


def _check_memory_plan_pins(values: dict[str, Any]) -> None:
    """The parts of the memory plan a request pins, checked where no model shape is needed (the planner checks
    the layer counts against the model). "auto" (or null) micro_batch_size is left to the planner."""
    if values["micro_batch_size"] == AUTO:
        values["micro_batch_size"] = None
    micro, per_gpu = values["micro_batch_size"], values["batch_size"] // values["n_gpus"]
    if micro is not None and per_gpu % micro:
        raise SpecError(
            "hyperparameters.micro_batch_size",
            f"hyperparameters.micro_batch_size ({micro}) must divide the sequences per GPU and step "
            f"(batch_size / n_gpus = {per_gpu}).",
        )
    if values["optimizer_in_backward"] and micro is not None and micro != per_gpu:
        raise SpecError(
            "hyperparameters.micro_batch_size",
            f"hyperparameters.optimizer_in_backward needs one micro-batch per step on each GPU (no gradient "
            f"accumulation): micro_batch_size must be batch_size / n_gpus = {per_gpu}, not {micro}.",
        )
