"""serving: the URL of a worker's chat completions server and the token the API calls it with

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 03:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("serving_url", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("serving_token", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("serving_token")
        batch_op.drop_column("serving_url")
