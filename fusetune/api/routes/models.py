"""/v1/models: the base models this server can fine-tune, and the tenant's fine-tuned results."""

from __future__ import annotations

from fastapi import APIRouter

from fusetune.api.deps import SessionDep, SettingsDep, StorageDep, TenantDep
from fusetune.api.errors import ApiError, not_found
from fusetune.api.schemas import ModelDeleted, ModelList, ModelObject
from fusetune.catalog import list_base_models
from fusetune.db import queries
from fusetune.storage import StorageError

router = APIRouter(prefix="/v1/models", tags=["models"])


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


@router.delete("/{model_id:path}", response_model=ModelDeleted)
def delete_model(
    model_id: str, session: SessionDep, settings: SettingsDep, storage: StorageDep, tenant: TenantDep
) -> ModelDeleted:
    """The tenant's fine-tuned model: no longer listed or usable, its checkpoints deleted; the job that made it
    keeps its record (events, metrics, results file) and names it in fine_tuned_model."""
    if model_id in list_base_models(settings):
        raise ApiError(403, f"'{model_id}' is a base model of this server; only fine-tuned models can be "
                       "deleted.", param="model", code="model_not_deletable")  # fmt: skip
    job = queries.job_of_fine_tuned_model(session, model_id, tenant)
    if job is None or not queries.has_fine_tuned_model(session, model_id, tenant):
        raise not_found("model", model_id, param="model")
    training_from_it = queries.unfinished_jobs_from_model(session, model_id, tenant)
    if training_from_it:
        raise ApiError(400, f"Model '{model_id}' is the base of fine-tuning jobs not yet finished "
                       f"({', '.join(training_from_it)}); cancel them or wait for them to end.",
                       param="model", code="model_in_use")  # fmt: skip
    queries.delete_fine_tuned_model(session, job)
    session.commit()
    # After the commit: a failed delete leaves folders no row names (harmless), never a listed model without
    # weights. The whole run: checkpoints pruned or left half-written by a crash go too.
    try:
        storage.delete_run(tenant, job.id)
    except StorageError as error:
        raise ApiError(503, f"The checkpoint store failed: {error}", code="storage_error") from error
    return ModelDeleted(id=model_id)
