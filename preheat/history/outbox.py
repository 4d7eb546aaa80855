"""The history outbox: a worker's history writes made while the database is away, kept on
local disk and written, in order and exactly once, when it is back.

A warmup does not need the database; only its record does. So a worker that cannot reach
Postgres goes on warming, and each write it could not make (a job started or finished, a
task's failure, a keep-alive tick, traffic counts) is appended to a SQLite file of its own.
The heartbeat thread replays the file in order; each entry is applied in one transaction
with a row in `applied_writes` under the entry's id, so an entry applied just before the
worker died is not applied twice when the file is replayed after its restart.

While entries wait, new writes queue behind them: a job's finish is never written before
its start. An entry the database refuses for good (a run deleted meanwhile, a constraint)
is set aside as `dead` with the reason, logged, and counted in the worker's state; it never
blocks the entries behind it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from preheat.core.text import safe_name
from preheat.history.db import DATABASE_AWAY, session_scope, utcnow

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    created_at TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    dead_reason TEXT
)
"""

Writer = Callable[[Session, dict], object]


@dataclass(frozen=True)
class EntryKind:
    """One kind of history write that may wait in an outbox: its name on disk and how it is
    applied, `apply(session, payload)`. Defined once, by the module that owns the write
    (preheat.history.service, preheat.fleet.traffic); the outbox imports none of them: whoever opens one
    says which kinds it keeps. The applied_writes row makes each entry count once, so
    `apply` need not be idempotent."""

    name: str
    apply: Writer


DEFERRED = object()  # what `write` returns when the entry waits in the outbox


@dataclass(frozen=True)
class Counts:
    pending: int
    dead: int

    def as_state(self) -> dict:
        return {"pending": self.pending, "dead": self.dead}


class Outbox:
    """One process's outbox file. Thread-safe: tasks write from the consumer thread, the
    heartbeat replays from its own."""

    def __init__(self, path: Path, source: str, kinds: Iterable[EntryKind]) -> None:
        self.path, self.source = path, source
        self.kinds = {kind.name: kind for kind in kinds}
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # FULL: an entry acknowledged here survives a power cut, like the row it stands for.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # Writing ---------------------------------------------------------------------------

    def write(self, kind: EntryKind, payload: dict) -> object:
        """Apply now when nothing waits and the database answers; otherwise keep it for
        replay and return DEFERRED. Errors other than "database away" are raised."""
        payload = as_stored(payload)
        if self.counts().pending == 0:
            try:
                with session_scope() as session:
                    return kind.apply(session, payload)
            except DATABASE_AWAY as exc:
                log.warning("database away (%s): %s kept in the outbox", _first_line(exc), kind.name)
        self.append(kind, payload)
        return DEFERRED

    def append(self, kind: EntryKind, payload: dict) -> str:
        if self.kinds.get(kind.name) is not kind:
            raise KeyError(f"no writer for outbox entries of kind {kind.name!r} in this outbox")
        entry_id = str(uuid.uuid4())
        with self._lock:
            self._db.execute(
                "INSERT INTO entries (id, kind, payload, created_at) VALUES (?, ?, ?, ?)",
                (entry_id, kind.name, json.dumps(payload, default=_json_default), utcnow().isoformat()),
            )
        return entry_id

    # Replaying -------------------------------------------------------------------------

    def replay(self, limit: int = 1000) -> int:
        """Apply waiting entries in order until the database is away again; returns how
        many were applied (or found applied already)."""
        applied = 0
        for seq, entry_id, kind, payload in self._waiting(limit):
            try:
                self._apply(entry_id, kind, json.loads(payload))
            except DATABASE_AWAY as exc:
                self._count_attempt(seq)
                log.info("outbox: database still away (%s); %d entries wait", _first_line(exc), self.counts().pending)
                break
            except (SQLAlchemyError, KeyError, ValueError, TypeError) as exc:
                self._set_dead(seq, f"{type(exc).__name__}: {_first_line(exc)}")
                continue
            self._remove(seq)
            applied += 1
        if applied:
            log.info("outbox: %d history writes applied after the database came back", applied)
        return applied

    def _apply(self, entry_id: str, kind: str, payload: dict) -> None:
        from preheat.history.models import AppliedWrite

        with session_scope() as session:
            key = uuid.UUID(entry_id)
            if session.scalars(select(AppliedWrite.id).where(AppliedWrite.id == key)).first() is not None:
                return  # applied before this process could remove it (it died in between)
            session.add(AppliedWrite(id=key, source=self.source, kind=kind))
            session.flush()
            self.kinds[kind].apply(session, payload)

    def _waiting(self, limit: int) -> list[tuple]:
        with self._lock:
            return self._db.execute(
                "SELECT seq, id, kind, payload FROM entries WHERE dead_reason IS NULL ORDER BY seq LIMIT ?", (limit,)
            ).fetchall()

    def _remove(self, seq: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM entries WHERE seq = ?", (seq,))

    def _count_attempt(self, seq: int) -> None:
        with self._lock:
            self._db.execute("UPDATE entries SET attempts = attempts + 1 WHERE seq = ?", (seq,))

    def _set_dead(self, seq: int, reason: str) -> None:
        log.error("outbox: entry %d refused by the database for good, set aside: %s", seq, reason)
        with self._lock:
            self._db.execute("UPDATE entries SET dead_reason = ? WHERE seq = ?", (reason, seq))

    # Reading ---------------------------------------------------------------------------

    def counts(self) -> Counts:
        with self._lock:
            pending, dead = self._db.execute(
                "SELECT COUNT(*) FILTER (WHERE dead_reason IS NULL), COUNT(*) FILTER (WHERE dead_reason IS NOT NULL) "
                "FROM entries"
            ).fetchone()
        return Counts(pending, dead)

    def entries(self) -> list[dict]:
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, id, kind, payload, created_at, attempts, dead_reason FROM entries ORDER BY seq"
            ).fetchall()
        return [
            {
                "seq": seq,
                "id": entry_id,
                "kind": kind,
                "payload": json.loads(payload),
                "created_at": created,
                "attempts": attempts,
                "dead_reason": dead,
            }
            for seq, entry_id, kind, payload, created, attempts, dead in rows
        ]


class OutboxCollector:
    """The outbox's counts on a worker's /metrics: an alert on pending > 0 for long is an
    alert on the database, seen from the workers."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        counts = self.outbox.counts()
        yield GaugeMetricFamily(
            "preheat_outbox_pending", "History writes waiting for the database.", value=counts.pending
        )
        yield GaugeMetricFamily(
            "preheat_outbox_dead", "History writes the database refused for good, set aside.", value=counts.dead
        )


def as_stored(payload: dict) -> dict:
    """The payload as a replay will read it (datetimes as ISO text): a writer sees one form,
    whether it writes at once or later."""
    return json.loads(json.dumps(payload, default=_json_default))


def _json_default(value):
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def path_for(folder: Path, nodename: str) -> Path:
    """One file per worker name: a worker restarted under its name replays what it left."""
    return folder / (safe_name(nodename) + ".sqlite3")


# This process's outbox ------------------------------------------------------------------

_OUTBOX: Outbox | None = None


def open_for(nodename: str, folder: Path, kinds: Iterable[EntryKind]) -> Outbox:
    """Open (or reopen) the worker's outbox for `kinds`; what it holds is replayed with the
    next heartbeat."""
    global _OUTBOX
    if _OUTBOX is not None:
        _OUTBOX.close()
    _OUTBOX = Outbox(path_for(folder, nodename), nodename, kinds)
    counts = _OUTBOX.counts()
    if counts.pending or counts.dead:
        log.warning(
            "outbox %s holds %d history writes from before this start (%d set aside)",
            _OUTBOX.path,
            counts.pending,
            counts.dead,
        )
    return _OUTBOX


def current() -> Outbox | None:
    return _OUTBOX


def close() -> None:
    global _OUTBOX
    if _OUTBOX is not None:
        _OUTBOX.close()
        _OUTBOX = None


def record(kind: EntryKind, payload: dict) -> object:
    """A history write: through this process's outbox when it has one (a worker), else
    directly (and the caller sees the error)."""
    if _OUTBOX is not None:
        return _OUTBOX.write(kind, payload)
    with session_scope() as session:
        return kind.apply(session, as_stored(payload))


def replay() -> int:
    return _OUTBOX.replay() if _OUTBOX is not None else 0
