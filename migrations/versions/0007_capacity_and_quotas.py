"""capacity and quotas: workers and their GPUs, tenants' limits, a job's GPUs and why it waits

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28 14:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.BigInteger(), nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "tenant_limits",
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("max_running_jobs", sa.Integer(), nullable=True),
        sa.Column("max_gpus", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("tenant"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("n_gpus", sa.Integer(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("waiting_reason", sa.String(255), nullable=True))
    # Jobs created before: their GPUs from the hyperparameters the row stores.
    jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("hyperparameters", sa.JSON),
                    sa.column("n_gpus", sa.Integer))  # fmt: skip
    connection = op.get_bind()
    for job_id, hyperparameters in connection.execute(sa.select(jobs.c.id, jobs.c.hyperparameters)).all():
        n_gpus = (hyperparameters or {}).get("n_gpus", 1)
        if isinstance(n_gpus, int) and n_gpus != 1:
            connection.execute(sa.update(jobs).where(jobs.c.id == job_id).values(n_gpus=n_gpus))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("waiting_reason")
        batch_op.drop_column("n_gpus")
    op.drop_table("tenant_limits")
    op.drop_table("workers")
