"""Alembic environment: the URL comes from preheat settings (or the caller), never from alembic.ini."""

from alembic import context
from sqlalchemy import text

from preheat.history import models  # noqa: F401 - registers the tables on Base.metadata
from preheat.history.db import Base, open_database

config = context.config
target_metadata = Base.metadata


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things in place
        transaction_per_migration=True,
    )


def run_migrations_online() -> None:
    engine = open_database(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        if connection.dialect.name == "postgresql":
            # Never wait forever behind a long transaction, and let only one migrator run:
            # every replica of the migrate job may start at once.
            connection.execute(text("SET lock_timeout = '10s'"))
            connection.execute(text("SET statement_timeout = '60s'"))
            connection.execute(text("SELECT pg_advisory_lock(7310241)"))
            connection.commit()
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_unlock(7310241)"))
            connection.commit()
    engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
