"""Alembic environment: the URL is the one the service uses (Settings), or one handed in by the caller."""

from alembic import context

from fusetune.config import Settings
from fusetune.db.models import Base
from fusetune.db.session import make_engine

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.attributes.get("url") or Settings().database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_url())
    with engine.connect() as connection:
        # Batch mode lets later migrations alter columns on SQLite too.
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
