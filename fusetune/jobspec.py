"""The job specification: one tree of pydantic models that the API validates, the job row stores and the
trainer runs. Every default is written here once.

- `HyperparametersRequest`: what a client may send (OpenAI's fields, "auto" allowed where OpenAI allows it,
  plus fusetune's own); `resolve()` turns it into
- `JobHyperparameters`: every value decided, stored on the job row and reported by the API; its training part,
  `TrainingHyperparameters`, is also the base of the trainer's `TrainConfig`, so the worker hands the stored
  values to the trainer as they are.
- `MethodSpec`: `method.type` as in the OpenAI API, one of the training methods registered in
  `fusetune.worker.train.methods`, with the settings of a method that has some (`DpoSpec` for "dpo").

The names a job may choose for `method.type` and `precision` come from the tables of the training package
(`methods.METHODS`, `precision.PRECISIONS`), which import no torch; adding an entry there offers it here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from fusetune.worker.train.methods import DEFAULT_METHOD, METHOD_TYPES
from fusetune.worker.train.precision import AUTO, PRECISION_NAMES

DEFAULT_N_EPOCHS = 3
# The most sequences per step "auto" picks; fewer when the training file has fewer examples.
DEFAULT_BATCH_SIZE = 8
DEFAULT_LEARNING_RATE_MULTIPLIER = 1.0
# The learning rate a multiplier of 1 means (FUSETUNE_BASE_LEARNING_RATE overrides it on a server).
DEFAULT_BASE_LEARNING_RATE = 1e-4
# DPO's temperature when "auto": the value of the DPO paper and of OpenAI's API.
DEFAULT_DPO_BETA = 0.1
DPO_SETTINGS = ("beta", "loss_type", "sft_weight")

MethodType = Literal[METHOD_TYPES]  # type: ignore[valid-type]
PrecisionName = Literal[PRECISION_NAMES]  # type: ignore[valid-type]


class SpecError(ValueError):
    """A combination of values that cannot run; `field` names the hyperparameter to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Spec(BaseModel):
    # A misspelt field is an error the user should see, not a setting silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraSpec(_Spec):
    """Low-rank adapters through peft on the base model's linear layers (the base weights stay frozen)."""

    r: int = Field(16, ge=1, le=1024)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # "all-linear": every linear layer but the output head; or module names such as ["q_proj", "v_proj"].
    target_modules: list[str] | Literal["all-linear"] = "all-linear"


class DpoSpec(_Spec):
    """Direct preference optimisation (fusetune/worker/train/methods/dpo.py)."""

    # How far the policy may move from the reference: larger keeps it closer (OpenAI allows up to 2).
    beta: float = Field(DEFAULT_DPO_BETA, gt=0, le=2)
    # "sigmoid": DPO's -log sigmoid(beta * margin); "ipo": IPO's squared loss on length-normalised log-ratios.
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    # Weight of a supervised term, the preferred output's per-token negative log-likelihood (0: none).
    sft_weight: float = Field(0.0, ge=0, le=100)


class MethodSpec(_Spec):
    """Which training method a job runs (fusetune/worker/train/methods/), with the settings of a method that
    has some under its own name, as the OpenAI API nests them."""

    type: MethodType = DEFAULT_METHOD
    dpo: DpoSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _settings_of_the_method(cls, values: Any) -> Any:
        if isinstance(values, dict):
            if values.get("type") == "dpo" and values.get("dpo") is None:
                values = {**values, "dpo": {}}
            if values.get("dpo") is not None and values.get("type") != "dpo":
                raise ValueError(f"method.dpo is given but method.type is '{values.get('type')}'")
        return values

    @model_serializer(mode="wrap")
    def _without_absent_settings(self, handler: Any) -> dict[str, Any]:
        # A method without settings is stored and reported as {"type": ...} alone.
        return {key: value for key, value in handler(self).items() if key == "type" or value is not None}


class TrainingHyperparameters(_Spec):
    """What a job trains with, every value decided."""

    n_epochs: int = Field(DEFAULT_N_EPOCHS, ge=1)
    batch_size: int = Field(DEFAULT_BATCH_SIZE, ge=1, description="sequences per optimizer step, all GPUs")
    learning_rate: float = Field(DEFAULT_BASE_LEARNING_RATE * DEFAULT_LEARNING_RATE_MULTIPLIER, gt=0)
    lr_scheduler: Literal["cosine", "linear"] = "cosine"
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    max_seq_length: int = Field(512, ge=16, le=131072)
    packing: bool = Field(
        False,
        description="Pack examples into rows of max_seq_length tokens (best-fit decreasing); attention stays "
        "within each example",
    )
    precision: PrecisionName = Field(
        AUTO,
        description="auto: bf16-sr on GPU, fp32 on CPU; or one of the modes of "
        "fusetune/worker/train/precision.py: fp32; bf16-mixed (fp32 weights and AdamW state, bf16 compute); "
        "bf16 (bf16 weights and state, rounded to nearest); bf16-sr (bf16 weights and state, the update "
        "stochastically rounded: fp32-master quality at half the memory)",
    )
    kernels: bool = Field(True, description="Patch the model with fusetune's Triton kernels (GPU)")
    gradient_checkpointing: bool = False
    lora: LoraSpec | None = Field(None, description="Train LoRA adapters instead of all weights")
    # With LoRA, checkpoints hold the adapter; this also saves the merged full weights, so that a checkpoint
    # loads with AutoModelForCausalLM.from_pretrained without the base model (the adapter moves to adapter/).
    merge_lora_on_save: bool = Field(False, description="Also save merged full weights (needs lora)")
    # "ddp": a full replica per GPU; "fsdp": parameters, gradients and optimizer state sharded (FSDP2, one unit
    # per decoder layer), for models that do not fit.
    distributed: Literal["ddp", "fsdp"] = Field("ddp", description="fsdp shards models too big for one GPU")

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

    n_epochs: int = Field(DEFAULT_N_EPOCHS, ge=1, le=100)
    batch_size: int = Field(DEFAULT_BATCH_SIZE, ge=1, le=4096)
    learning_rate_multiplier: float = Field(DEFAULT_LEARNING_RATE_MULTIPLIER, gt=0, le=1000)
    n_gpus: int = Field(1, ge=1, le=64, description="Processes (GPUs) the job trains on")


class HyperparametersRequest(JobHyperparameters):
    """Hyperparameters as a client sends them; "auto" (the default) is decided by `resolve`."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    n_epochs: int | Literal["auto"] = "auto"  # type: ignore[assignment]
    batch_size: int | Literal["auto"] = "auto"  # type: ignore[assignment]
    learning_rate_multiplier: float | Literal["auto"] = "auto"  # type: ignore[assignment]
    learning_rate: float | None = Field(  # type: ignore[assignment]
        None, gt=0, le=1, description="Overrides base x multiplier"
    )

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

    def resolve(self, example_count: int, base_learning_rate: float) -> JobHyperparameters:
        """Every "auto" decided, so that the job row says exactly what will run. Raises SpecError for a
        combination no trainer can run."""
        values = self.model_dump(include=set(JobHyperparameters.model_fields))
        if values["n_epochs"] == "auto":
            values["n_epochs"] = DEFAULT_N_EPOCHS
        n_gpus = values["n_gpus"]
        if values["batch_size"] == "auto":
            # Every process gets the same number of sequences per step.
            values["batch_size"] = max(1, min(DEFAULT_BATCH_SIZE, example_count) // n_gpus) * n_gpus
        elif values["batch_size"] % n_gpus:
            raise SpecError(
                "batch_size",
                f"hyperparameters.batch_size ({values['batch_size']}) must be a multiple of "
                f"hyperparameters.n_gpus ({n_gpus}).",
            )
        if values["learning_rate_multiplier"] == "auto":
            values["learning_rate_multiplier"] = DEFAULT_LEARNING_RATE_MULTIPLIER
        if values["learning_rate"] is None:
            values["learning_rate"] = base_learning_rate * values["learning_rate_multiplier"]
        return JobHyperparameters(**values)


class DpoHyperparametersRequest(HyperparametersRequest):
    """`method.dpo.hyperparameters`: the usual ones plus DPO's (OpenAI's `beta`; fusetune's `loss_type`,
    `sft_weight`)."""

    beta: float | Literal["auto"] = "auto"
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    sft_weight: float = Field(0.0, ge=0, le=100)

    @field_validator("beta")
    @classmethod
    def _beta(cls, value: float | str) -> float | str:
        if isinstance(value, float | int) and not 0 < value <= 2:
            raise ValueError("must be greater than 0 and at most 2")
        return value

    def dpo_spec(self) -> DpoSpec:
        beta = DEFAULT_DPO_BETA if self.beta == "auto" else self.beta
        return DpoSpec(beta=beta, loss_type=self.loss_type, sft_weight=self.sft_weight)


class JobSpec(_Spec):
    """A job's method and hyperparameters, as its row stores them (the method under the "method" key of the
    row's `hyperparameters` column; rows from before methods existed are supervised)."""

    method: MethodSpec = MethodSpec()
    hyperparameters: JobHyperparameters = JobHyperparameters()

    def to_row(self) -> dict[str, Any]:
        method = self.method.model_dump(mode="json", exclude_none=True)
        return {**self.hyperparameters.model_dump(mode="json"), "method": method}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> JobSpec:
        values = dict(row)
        method = values.pop("method", None) or {}
        return cls(method=MethodSpec(**method), hyperparameters=JobHyperparameters(**values))
