"""One DeclarativeBase, one database connection pool per process, one way to open a transaction.

(SQLAlchemy calls the pool and dialect an `Engine`; in preheat the engine is the inference
engine, preheat/workers/engine, so here it is the database.)
"""

from __future__ import annotations

import contextlib
import datetime as dt
import enum
import functools
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import ClassVar

from sqlalchemy import JSON, DateTime, Enum, MetaData, create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from preheat.core.settings import get_settings

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


def open_database(url: str, timeout_s: float | None = None) -> Engine:
    """The database at `url` (a SQLAlchemy Engine). With `timeout_s` every call is bounded: connecting (libpq's
    connect_timeout), a pool checkout, each statement on the server (statement_timeout),
    the socket (TCP keepalives and tcp_user_timeout: a partition that drops packets), and a
    server that accepts bytes but answers none (a frozen server, a stalled proxy: the stall
    watchdog). A call past its bound fails as DATABASE_AWAY; a worker's write then waits in
    its outbox. Without `timeout_s` (migrations) statements run as long as they need."""
    if url.startswith("sqlite"):
        engine = create_engine(url)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    # A database behind a partition answers nothing: give up on connecting after a while
    # (the worker's outbox keeps its writes) rather than hang the caller.
    connect_args = {} if "connect_timeout=" in url else {"connect_timeout": max(2, round(timeout_s or 10))}
    if timeout_s is None:
        return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5, connect_args=connect_args)
    connect_args |= {
        "options": f"-c statement_timeout={int(timeout_s * 1000)}",
        "keepalives": 1,
        "keepalives_idle": max(1, int(timeout_s)),
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": int(timeout_s * 1000),
    }
    # The ping on checkout is STALL_WATCHDOG's own (bounded); SQLAlchemy's would not be.
    engine = create_engine(url, pool_size=5, max_overflow=5, pool_timeout=timeout_s, connect_args=connect_args)
    STALL_WATCHDOG.watch(engine, timeout_s)
    return engine


class StallWatchdog:
    """Ends a database call that has waited on the server past its bound, by shutting its
    socket down: the waiting thread then gets an OperationalError and the connection is
    discarded. This is the one bound that holds when the server's kernel still takes bytes
    but the server answers none (no timeout on the server or in TCP fires then), and
    psycopg waits on its socket with no deadline of its own."""

    def __init__(self) -> None:
        self._busy: dict[int, tuple[object, float]] = {}  # id(dbapi connection) -> (it, deadline)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, engine: Engine, timeout_s: float) -> None:
        def begin(conn, *_):
            self._arm(conn.connection.dbapi_connection, timeout_s)

        def end(conn, *_):
            self._disarm(conn.connection.dbapi_connection)

        # Statements, and the transaction ends, which are round trips of their own.
        for name, fn in (
            ("before_cursor_execute", begin),
            ("after_cursor_execute", end),
            ("commit", begin),
            ("rollback", begin),
        ):
            event.listen(engine, name, fn)
        event.listen(engine.pool, "checkout", lambda dbapi_connection, *_: self._ping(dbapi_connection, timeout_s))
        event.listen(engine.pool, "checkin", lambda dbapi_connection, *_: self._disarm(dbapi_connection))
        event.listen(engine.pool, "reset", lambda dbapi_connection, *_: self._disarm(dbapi_connection))

    def _ping(self, dbapi_connection, timeout_s: float) -> None:
        """A pooled connection is asked `SELECT 1` before use, within the bound: a dead or
        stalled one is replaced (DisconnectionError makes the pool connect afresh)."""
        from sqlalchemy.exc import DisconnectionError

        self._arm(dbapi_connection, timeout_s)
        try:
            with dbapi_connection.cursor() as cursor:
                cursor.execute("SELECT 1")
            dbapi_connection.rollback()
        except Exception as exc:
            raise DisconnectionError(f"pooled connection failed its ping: {exc}") from exc
        finally:
            self._disarm(dbapi_connection)

    def _arm(self, dbapi_connection, timeout_s: float) -> None:
        if dbapi_connection is None:
            return
        with self._lock:
            self._busy[id(dbapi_connection)] = (dbapi_connection, time.monotonic() + timeout_s + 1.0)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="preheat-db-stall-watchdog", daemon=True)
                self._thread.start()

    def _disarm(self, dbapi_connection) -> None:
        with self._lock:
            self._busy.pop(id(dbapi_connection), None)

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self._lock:
                overdue = [conn for conn, deadline in self._busy.values() if deadline < now]
                for conn in overdue:
                    self._busy.pop(id(conn), None)
            for conn in overdue:
                self._end(conn)

    @staticmethod
    def _end(dbapi_connection) -> None:
        """Still waiting on the server: shut its socket down (the waiting thread wakes with
        an error). A connection that finished meanwhile is idle, and is left alone."""
        import psycopg

        pgconn = getattr(dbapi_connection, "pgconn", None)
        if pgconn is None or pgconn.transaction_status != psycopg.pq.TransactionStatus.ACTIVE:
            return
        with contextlib.suppress(OSError, ValueError):
            sock = socket.socket(fileno=os.dup(pgconn.socket))
            with sock:
                sock.shutdown(socket.SHUT_RDWR)


STALL_WATCHDOG = StallWatchdog()


@functools.cache
def database() -> Engine:
    settings = get_settings()
    if settings.database.startswith("sqlite"):
        settings.home.mkdir(parents=True, exist_ok=True)
    return open_database(settings.database, timeout_s=settings.db_timeout_s)


@functools.cache
def _session_factory() -> sessionmaker[Session]:
    return sessionmaker(database(), expire_on_commit=False)


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


def reset_connections() -> None:
    """Forget the connection pool (after a fork, or when tests change PREHEAT_DATABASE_URL)."""
    if database.cache_info().currsize:
        database().dispose(close=False)
    database.cache_clear()
    _session_factory.cache_clear()
