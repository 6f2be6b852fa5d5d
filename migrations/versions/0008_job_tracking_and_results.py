"""tracking and results: a job's integrations, results file and estimated finish; the best checkpoint

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27 16:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("integrations", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("result_file_id", sa.String(64), nullable=True))
        batch_op.add_column(sa.Column("estimated_finish", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("best", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_column("best")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("estimated_finish")
        batch_op.drop_column("result_file_id")
        batch_op.drop_column("integrations")
