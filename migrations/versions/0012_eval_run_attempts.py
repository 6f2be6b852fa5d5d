"""eval runs: when the worker claimed the run, and how many times one did (a run whose worker died is requeued
until max_attempts, as a job is)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 06:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("eval_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("started_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("eval_runs", schema=None) as batch_op:
        batch_op.drop_column("started_at")
        batch_op.drop_column("attempts")
