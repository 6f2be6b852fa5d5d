"""The training methods a job may choose (`method.type`, as in the OpenAI API), as one table.

Each method is one `Method` entry: its line format, how its examples become rows, and its own settings as one
pydantic model (`DpoSettings`). From that one model come
- the stored specification, `MethodSpec`: a union discriminated by `type`, `{"type": "dpo", "dpo": {...}}`,
  which the job row keeps and the trainer's configuration carries (`method.settings`);
- the request, `MethodRequest`: OpenAI's `{"type": t, t: {"hyperparameters": {...}}}`, where a method's
  hyperparameters are the shared ones plus its settings, each of which may be "auto"; a setting the OpenAI API
  places beside `hyperparameters` (reinforcement's `grader`) is one of the method's `request_fields`.
The API's OpenAPI schema therefore documents every method. The training half of a method lives in
fusetune/worker/train/methods/<type>.py, found there by its `type`.

Adding a method is its settings model (if it has settings) and one entry in `METHODS`, plus its training module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from fusetune.spec.examples import PREFERENCE, REINFORCEMENT, SUPERVISED, ExampleFormat
from fusetune.spec.graders import Grader
from fusetune.spec.hyperparameters import AUTO, STRICT, HyperparametersRequest, Spec, within_bounds

SFT_WEIGHT = (
    "Weight of a supervised term, the preferred output's mean token negative log-likelihood (0: none)"
)


class MethodSettings(Spec):
    """The base of a method's own settings (every field has a default: "auto" in a request means it; only a
    `request_fields` setting, given beside the hyperparameters, may be required)."""


class DpoSettings(MethodSettings):
    """Direct preference optimisation (fusetune/worker/train/methods/dpo.py)."""

    # The default is the DPO paper's and the OpenAI API's; OpenAI allows up to 2.
    beta: float = Field(
        0.1, gt=0, le=2, description="How far the policy may move from the reference: larger keeps it closer"
    )
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid",
        description="sigmoid: DPO's -log sigmoid(beta * margin); ipo: IPO's squared loss on length-normalised "
        "log-ratios",
    )
    sft_weight: float = Field(0.0, ge=0, le=100, description=SFT_WEIGHT)


class SimpoSettings(MethodSettings):
    """Simple preference optimisation (fusetune/worker/train/methods/simpo.py): no reference model."""

    # The SimPO paper tuned beta to 2-2.5 for instruction-tuned models; DPO's beta means something else.
    beta: float = Field(
        2.0, gt=0, le=100, description="Scale of the mean token log-probability that makes a side's reward"
    )
    gamma_beta_ratio: float = Field(
        0.5, ge=0, le=10, description="The target margin between the two rewards, as a fraction of beta"
    )
    sft_weight: float = Field(0.0, ge=0, le=100, description=SFT_WEIGHT)


# Completions sampled per prompt by default (reinforcement's `n`): DeepSeekMath's GRPO sampled 64, TRL's default is
# 8; 8 keeps a group's reward spread informative at an eighth of the generation.
DEFAULT_COMPLETIONS_PER_PROMPT = 8


class ReinforcementSettings(MethodSettings):
    """Reinforcement fine-tuning by GRPO (fusetune/worker/train/methods/reinforcement.py): completions sampled
    from the policy, scored by the grader, and trained on by their advantage within their prompt's group.

    The first five after the grader are the OpenAI API's own hyperparameters; the rest are fusetune's."""

    grader: Grader = Field(description="What scores a completion, as the OpenAI API's grader objects")
    eval_interval: int | None = Field(
        None,
        ge=1,
        description="Steps between evaluations on the validation file (null: at the end of each epoch)",
    )
    eval_samples: int | None = Field(
        None, ge=1, description="Validation prompts evaluated, the first of the file (null: all of them)"
    )
    compute_multiplier: float = Field(
        1.0,
        gt=0,
        le=16,
        description="Scales the completions sampled per prompt (n), the exploration per step",
    )
    reasoning_effort: Literal["default", "low", "medium", "high"] = Field(
        "default",
        description="Accepted as the OpenAI API sends it; the models served here have no reasoning mode",
    )
    n: int = Field(
        DEFAULT_COMPLETIONS_PER_PROMPT,
        ge=2,
        le=256,
        description="Completions sampled per prompt (a group; its rewards are normalised within it)",
    )
    max_completion_tokens: int = Field(
        256, ge=1, le=32768, description="Tokens a completion may have at most"
    )
    temperature: float = Field(1.0, gt=0, le=2, description="Sampling temperature of the completions")
    clip_epsilon: float = Field(
        0.2, gt=0, le=1, description="PPO's clip: the probability ratio is held within [1 - eps, 1 + eps]"
    )
    kl_beta: float = Field(
        0.0,
        ge=0,
        le=10,
        description="Weight of the per-token KL divergence to the starting model (0: none, no reference kept)",
    )

    @property
    def completions_per_prompt(self) -> int:
        """`n` scaled by `compute_multiplier` (at least 2: a group of one has no spread)."""
        return max(2, round(self.n * self.compute_multiplier))


@dataclass(frozen=True)
class Method:
    type: str
    description: str
    example_format: ExampleFormat
    settings: type[MethodSettings] | None = None
    # Sequences the method makes of one example (a row of the run counts as one of `batch_size`), whether rows
    # may be packed, whether a forward pass over the data runs before training (a reference model's scores).
    rows_per_example: int = 1
    supports_packing: bool = True
    has_reference_pass: bool = False
    # Whether the method runs sharded (FSDP2) on several GPUs; `fsdp_refusal` says why not.
    fsdp_refusal: str | None = None
    # Settings the OpenAI API's request places beside `hyperparameters`, not in it (reinforcement's grader).
    request_fields: tuple[str, ...] = ()


METHODS: dict[str, Method] = {
    method.type: method
    for method in (
        Method(
            "supervised", "next-token cross-entropy on the assistant's tokens", SUPERVISED,
        ),
        Method(
            "dpo", "direct preference optimisation against the frozen starting model", PREFERENCE, DpoSettings,
            rows_per_example=2, supports_packing=False, has_reference_pass=True,
        ),
        Method(
            "simpo", "simple preference optimisation: length-normalised rewards, no reference model", PREFERENCE,
            SimpoSettings, rows_per_example=2, supports_packing=False,
        ),
        Method(
            "reinforcement", "GRPO: sampled completions scored by a grader, advantages normalised per prompt",
            REINFORCEMENT, ReinforcementSettings, rows_per_example=DEFAULT_COMPLETIONS_PER_PROMPT,
            supports_packing=False, request_fields=("grader",),
        ),
    )
}  # fmt: skip
DEFAULT_METHOD = "supervised"
MethodType = Literal[tuple(METHODS)]  # type: ignore[valid-type]


def method_of_record(record: object) -> str:
    """The first method whose line format claims a decoded JSONL record (the default method when none does)."""
    return next(
        (name for name, method in METHODS.items() if method.example_format.recognizes(record)), DEFAULT_METHOD
    )


def reads_the_same_files(first: str, second: str) -> bool:
    """Whether two methods train on files of one line format (a file uploaded for one serves the other)."""
    return METHODS[first].example_format is METHODS[second].example_format


def _model_name(method_type: str, suffix: str) -> str:
    return "".join(part.title() for part in method_type.replace("-", "_").split("_")) + suffix


# ---- the stored specification -------------------------------------------------------------------------------


class _StoredMethod(Spec):
    type: str

    @property
    def settings(self) -> MethodSettings | None:
        """The method's own settings (None for a method without any)."""
        return getattr(self, self.type, None)


def _stored_model(method: Method) -> type[_StoredMethod]:
    fields: dict[str, Any] = {"type": (Literal[method.type], method.type)}
    if method.settings is not None:
        fields[method.type] = (method.settings, Field(default_factory=method.settings))
    return create_model(_model_name(method.type, "MethodSpec"), __base__=_StoredMethod, **fields)


def _type_of(value: Any) -> str:
    # A row stored before methods existed has no method; a method without a type is the default one.
    if isinstance(value, dict):
        return value.get("type", DEFAULT_METHOD)
    return getattr(value, "type", DEFAULT_METHOD)


STORED_MODELS: dict[str, type[_StoredMethod]] = {
    name: _stored_model(method) for name, method in METHODS.items()
}
MethodSpec = Annotated[
    Union[tuple(Annotated[model, Tag(name)] for name, model in STORED_MODELS.items())],  # noqa: UP007
    Discriminator(_type_of),
]
METHOD_SPEC = TypeAdapter(MethodSpec)


def method_spec(method_type: str = DEFAULT_METHOD, **settings: Any) -> _StoredMethod:
    """The stored specification of a method, its settings given by name (the others at their defaults)."""
    return METHOD_SPEC.validate_python({"type": method_type, **({method_type: settings} if settings else {})})


# ---- the request, in the OpenAI API's shape --------------------------------------------------------------------


def _settings_bounds(settings: type[MethodSettings]):
    def check(cls, value: Any, info: ValidationInfo) -> Any:
        return within_bounds(settings, info.field_name, value)

    return field_validator(*settings.model_fields, check_fields=False)(classmethod(check))


@cache
def hyperparameters_request(method_type: str) -> type[HyperparametersRequest]:
    """`method.<type>.hyperparameters`: the shared hyperparameters plus the method's settings, each "auto" by
    default and otherwise held to the settings model's bounds."""
    settings = METHODS[method_type].settings
    if settings is None:
        return HyperparametersRequest
    fields = {
        name: (field.annotation | Literal["auto"], AUTO)
        for name, field in settings.model_fields.items()
        if name not in METHODS[method_type].request_fields
    }
    return create_model(
        _model_name(method_type, "HyperparametersRequest"),
        __base__=HyperparametersRequest,
        __validators__={"_settings_within_bounds": _settings_bounds(settings)},
        **fields,
    )


def settings_from_request(
    method_type: str, hyperparameters: BaseModel | None, beside: dict[str, Any] | None = None
) -> _StoredMethod:
    """The stored method of a request's `method.<type>.hyperparameters` ("auto" settings at their defaults) and
    of the settings given `beside` them (the method's `request_fields`)."""
    method = METHODS[method_type]
    if method.settings is None or (hyperparameters is None and not beside):
        return method_spec(method_type)
    chosen = {
        name: getattr(hyperparameters, name)
        for name in method.settings.model_fields
        if hyperparameters is not None and name not in method.request_fields
    }
    chosen = {name: value for name, value in chosen.items() if value != AUTO}
    return method_spec(method_type, **chosen, **(beside or {}))


class _MethodRequestBase(BaseModel):
    model_config = STRICT
    type: str

    @model_validator(mode="after")
    def _settings_under_their_type(self) -> _MethodRequestBase:
        for name in type(self).model_fields:
            if name != "type" and getattr(self, name) is not None and name != self.type:
                raise ValueError(f"method.{name} is given but method.type is '{self.type}'")
        required = METHODS[self.type].request_fields
        if required and getattr(self, self.type, None) is None:
            raise ValueError(f"method.{self.type} with its {', '.join(required)} is required")
        return self

    def hyperparameters(self) -> HyperparametersRequest | None:
        settings = getattr(self, self.type, None)
        return settings.hyperparameters if settings is not None else None

    def spec(self) -> _StoredMethod:
        settings = getattr(self, self.type, None)
        beside = {name: getattr(settings, name) for name in METHODS[self.type].request_fields}
        return settings_from_request(self.type, self.hyperparameters(), beside)


def method_in_request_shape(stored: Mapping[str, Any] | None, shared: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `MethodRequest.spec()`: a stored method (the dict a job row keeps; None for a row older than
    methods) in the OpenAI API's shape, `{"type": t, t: {"hyperparameters": {...}, ...}}`. The method's own
    settings sit under `hyperparameters` beside the `shared` ones (as OpenAI reports DPO's beta), and its
    `request_fields` (reinforcement's grader) beside `hyperparameters`, where the request gave them."""
    method_type = _type_of(stored or {})
    settings = dict((stored or {}).get(method_type) or {})
    beside = {name: settings.pop(name) for name in METHODS[method_type].request_fields if name in settings}
    return {"type": method_type, method_type: {"hyperparameters": {**shared, **settings}, **beside}}


def _method_request_model() -> type[_MethodRequestBase]:
    fields: dict[str, Any] = {"type": (MethodType, DEFAULT_METHOD)}
    for name, method in METHODS.items():
        beside = {
            field: (method.settings.model_fields[field].annotation, ...) for field in method.request_fields
        }
        settings_request = create_model(
            _model_name(name, "MethodRequest"),
            __config__=STRICT,
            __doc__=method.description,
            hyperparameters=(hyperparameters_request(name) | None, None),
            **beside,
        )
        fields[name] = (settings_request | None, None)
    return create_model(
        "MethodRequest",
        __base__=_MethodRequestBase,
        __doc__='`method` as the OpenAI API has it: `{"type": t, t: {"hyperparameters": {...}}}`, t one of '
        "the methods of fusetune/spec/methods.py",
        **fields,
    )


MethodRequest = _method_request_model()
