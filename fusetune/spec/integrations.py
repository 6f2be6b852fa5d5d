"""A job's `integrations`, as the OpenAI fine-tuning API spells them: where the trainer also reports the run.

- `{"type": "wandb", "wandb": {"project", "name", "entity", "tags"}}`: Weights & Biases, through the `wandb`
  library (offline, into the job's run folder, when the worker has no W&B key or no route to W&B).
- `{"type": "mlflow", "mlflow": {"tracking_uri", "experiment_name", "run_name", "tags"}}`: an MLflow tracking
  server. Without `tracking_uri` the server's `FUSETUNE_MLFLOW_TRACKING_URI`; a job may name only an http(s)
  server, never a path on the worker's disk.

The trainer's side is fusetune/worker/train/tracking.py.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, TypeAdapter, field_validator

from fusetune.spec.hyperparameters import Spec

# Short, printable names: they become run names, tags and folder names on the tracker's side.
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]


class WandbSettings(Spec):
    project: Name = Field(description="The W&B project the run is logged to")
    name: Name | None = Field(None, description="The run's display name (default: the job id)")
    entity: Name | None = Field(None, description="The W&B team or user (default: the API key's default)")
    tags: list[Name] | None = Field(None, max_length=64, description="Tags of the run")


class WandbIntegration(Spec):
    type: Literal["wandb"]
    wandb: WandbSettings


class MlflowSettings(Spec):
    tracking_uri: str | None = Field(
        None,
        max_length=2048,
        description="An http(s) MLflow tracking server; default: the server's FUSETUNE_MLFLOW_TRACKING_URI",
    )
    experiment_name: Name | None = Field(None, description="Default: fusetune")
    run_name: Name | None = Field(None, description="Default: the job id")
    tags: dict[Name, Annotated[str, Field(max_length=5000)]] | None = Field(None, max_length=64)

    @field_validator("tracking_uri")
    @classmethod
    def _http_only(cls, value: str | None) -> str | None:
        # A file: or database URI would have the worker write wherever the job asks.
        if value is not None and (
            urlsplit(value).scheme not in ("http", "https") or not urlsplit(value).netloc
        ):
            raise ValueError("tracking_uri must be an http:// or https:// URL of an MLflow tracking server")
        return value


class MlflowIntegration(Spec):
    type: Literal["mlflow"]
    mlflow: MlflowSettings = MlflowSettings()


def _one_of_each_type(integrations: list) -> list:
    # Two W&B runs of one job would only split its history.
    types = [integration.type for integration in integrations]
    for name in sorted(set(types)):
        if types.count(name) > 1:
            raise ValueError(f"at most one integration of type '{name}'")
    return integrations


INTEGRATION_TYPES = ("wandb", "mlflow")


def _integration_tag(value: object) -> str:
    # Quoted, the tag in a validation error's location is no field's name (fusetune/api/errors.py leaves it out):
    # `integrations.0.mlflow.tracking_uri`, where the plain tag "mlflow" read `integrations.0.mlflow.mlflow...`.
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type='{kind}'"


def _known_type(value: object) -> object:
    if isinstance(value, dict) and value.get("type") not in INTEGRATION_TYPES:
        raise ValueError(f"type must be one of {', '.join(INTEGRATION_TYPES)} (got {value.get('type')!r})")
    return value


Integration = Annotated[
    Annotated[WandbIntegration, Tag("type='wandb'")] | Annotated[MlflowIntegration, Tag("type='mlflow'")],
    Discriminator(_integration_tag),
    BeforeValidator(_known_type),
]
Integrations = Annotated[list[Integration], Field(max_length=2), AfterValidator(_one_of_each_type)]
INTEGRATIONS: TypeAdapter[list[WandbIntegration | MlflowIntegration]] = TypeAdapter(Integrations)
