"""One DeclarativeBase, one engine per process, one way to open a transaction."""

from __future__ import annotations

import contextlib
import datetime as dt
import enum
import functools
import uuid
from collections.abc import Iterator
from typing import ClassVar

from sqlalchemy import JSON, DateTime, Enum, MetaData, create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from preheat.settings import get_settings

# Stable constraint names, so Alembic migrations name what they create and drop.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# The database is away (refused, reset, timed out, locked): worth waiting for. Anything
# else is an answer, and waiting would not change it.
DATABASE_AWAY = (OperationalError, InterfaceError)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def aware(moment: dt.datetime) -> dt.datetime:
    """SQLite hands datetimes back without their zone; every one stored here is UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    # Enums are stored as their string values in a VARCHAR (no native PG enum types),
    # so adding a state is a one-line migration instead of an ALTER TYPE dance.
    type_annotation_map: ClassVar[dict] = {
        enum.Enum: Enum(
            enum.Enum,
            native_enum=False,
            create_constraint=False,
            length=32,
            values_callable=lambda e: [m.value for m in e],
        ),
        dict: JSON,
        list: JSON,
        dt.datetime: DateTime(timezone=True),
    }


class Model(Base):
    __abstract__ = True

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # WAL lets the CLI read history while a worker writes it; the busy timeout makes
    # concurrent writers wait instead of failing with "database is locked".
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    # A database behind a partition answers nothing: give up on connecting after a while
    # (the worker's outbox keeps its writes) rather than hang the caller.
    connect_args = {} if "connect_timeout=" in url else {"connect_timeout": 10}
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5, connect_args=connect_args)


@functools.cache
def get_engine() -> Engine:
    settings = get_settings()
    if settings.database.startswith("sqlite"):
        settings.home.mkdir(parents=True, exist_ok=True)
    return make_engine(settings.database)


@functools.cache
def _session_factory() -> sessionmaker[Session]:
    return sessionmaker(get_engine(), expire_on_commit=False)


@contextlib.contextmanager
def session_scope() -> Iterator[Session]:
    """A transaction: committed when the block ends, rolled back if it raises."""
    session = _session_factory()()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def reset_engine() -> None:
    """Forget the engine (after a fork, or when tests change PREHEAT_DATABASE_URL)."""
    if get_engine.cache_info().currsize:
        get_engine().dispose(close=False)
    get_engine.cache_clear()
    _session_factory.cache_clear()
