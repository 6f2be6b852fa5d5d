"""/v1/models: the base models this server can fine-tune, and the tenant's fine-tuned results."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from fusetune.api.deps import SessionDep, SettingsDep, TenantDep
from fusetune.api.errors import not_found
from fusetune.catalog import list_base_models
from fusetune.db import queries

router = APIRouter(prefix="/v1/models", tags=["models"])


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


def _all_models(session, settings, tenant) -> list[ModelObject]:
    models = [ModelObject(id=name, created=0, owned_by="system") for name in list_base_models(settings)]
    fine_tuned = queries.fine_tuned_models(session, tenant)
    models += [ModelObject(id=name, created=finished or 0, owned_by=tenant) for name, finished in fine_tuned]
    return models


@router.get("", response_model=ModelList)
def list_models(session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> ModelList:
    return ModelList(data=_all_models(session, settings, tenant))


@router.get("/{model_id:path}", response_model=ModelObject)
def retrieve_model(
    model_id: str, session: SessionDep, settings: SettingsDep, tenant: TenantDep
) -> ModelObject:
    for model in _all_models(session, settings, tenant):
        if model.id == model_id:
            return model
    raise not_found("model", model_id, param="model")
