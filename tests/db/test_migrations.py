"""The schema comes only from Alembic: upgrade head on an empty database, downgrade to base, upgrade again."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from fusetune.db.migrate import downgrade, upgrade
from fusetune.db.models import Base
from fusetune.db.session import make_engine
from tests.services import postgres_database

TABLES = {"files", "jobs", "job_events", "job_metrics", "checkpoints"}


def _roundtrip(url: str) -> None:
    engine = make_engine(url)
    upgrade(url)
    inspector = inspect(engine)
    assert TABLES <= set(inspector.get_table_names())
    # The migrations build exactly what the ORM models describe.
    for table in Base.metadata.sorted_tables:
        columns = {c["name"] for c in inspect(engine).get_columns(table.name)}
        assert columns == {c.name for c in table.columns}, table.name
    downgrade(url, "base")
    assert not (TABLES & set(inspect(engine).get_table_names()))
    upgrade(url)
    assert TABLES <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_sqlite_upgrade_downgrade_upgrade(tmp_path):
    _roundtrip(f"sqlite:///{tmp_path / 'm.db'}")


def test_postgres_upgrade_downgrade_upgrade():
    with postgres_database() as url:
        _roundtrip(url)


@pytest.mark.parametrize("revision", ["head"])
def test_upgrade_is_idempotent(tmp_path, revision):
    url = f"sqlite:///{tmp_path / 'i.db'}"
    upgrade(url, revision)
    upgrade(url, revision)
