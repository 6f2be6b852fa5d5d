"""file method: the training method whose line format a file is in

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 02:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Files uploaded before methods had formats of their own are supervised ones.
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.add_column(sa.Column("method", sa.String(32), nullable=False, server_default="supervised"))


def downgrade() -> None:
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_column("method")
