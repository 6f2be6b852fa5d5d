"""Deleting a tenant's data (``fusetune tenants delete``): its rows in SQL and its files and checkpoints in the
store, whichever store that is.

The rows go first, in one transaction, and the stored files after the commit, as when one file is deleted: a
failure in between leaves objects no row names (the command can be run again to remove them), never a row
whose file is gone. A job a worker is training would go on writing checkpoints under the tenant's prefix, so
the deletion is refused while one runs; jobs not started yet are cancelled in the same transaction, so none
starts meanwhile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fusetune.db import queries
from fusetune.storage import Storage

# A tenant names a prefix in the object store and a label in logs and metrics: letters, digits, ".", "_" and "-",
# starting with a letter or digit, at most 64 characters (the column's width).
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def tenant_name_problem(name: str) -> str | None:
    """Why `name` cannot be a tenant's, or None when it can."""
    if TENANT_NAME.fullmatch(name):
        return None
    return (
        f"invalid tenant name {name!r}: use 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or "
        "a digit"
    )


class TenantBusy(Exception):
    """The tenant has running jobs; the message names them and what to do."""


@dataclass(frozen=True)
class TenantDeletion:
    files: int
    jobs: int
    checkpoints: int
    api_keys: int


def delete_tenant_data(session_factory, storage: Storage, tenant: str) -> TenantDeletion:
    with session_factory() as session:
        queries.stop_unstarted_jobs(session, tenant)
        running = queries.running_job_ids(session, tenant)
        if running:
            session.rollback()
            raise TenantBusy(
                f"tenant '{tenant}' has {len(running)} running job(s): {', '.join(running)}. Cancel them "
                "(POST /v1/fine_tuning/jobs/<id>/cancel with one of the tenant's keys) or wait until they "
                "finish, then run this again."
            )
        rows = queries.delete_tenant_rows(session, tenant)
        session.commit()
    # The local store keeps files and runs by id, not by tenant; the object store also drops the whole prefix,
    # with what no row named any more (a checkpoint a crash cut short, an upload abandoned).
    for storage_name in rows.file_storage_names:
        storage.delete_file(tenant, storage_name)
    for job_id in rows.job_ids:
        storage.delete_run(tenant, job_id)
    storage.delete_tenant(tenant)
    return TenantDeletion(
        files=len(rows.file_storage_names),
        jobs=len(rows.job_ids),
        checkpoints=len(rows.checkpoint_storage_paths),
        api_keys=rows.api_keys,
    )
