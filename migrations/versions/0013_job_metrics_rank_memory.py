"""job metrics: each rank's memory peaks of the step, with its node and host (the values keep their maximum)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 10:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rank_memory", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        batch_op.drop_column("rank_memory")
