"""The leader lock of beat: a lease row in the history database.

Every beat tries to take or renew the lease each tick; the one holding it fires slots.
A leader that dies stops renewing, and a standby takes over once the lease has expired
(at most lease + one tick later); one that stops cleanly gives it up at once. The lease
is in the database, not in Redis, so a Redis restart cannot hand it to a second beat,
and it is kept by a conditional UPDATE, which is atomic on Postgres and SQLite alike.

The lease saves work; it is not what stops a double fire. A beat that stalls past its
lease (a long GC pause, a frozen VM) may still think it leads for a moment: the unique
(schedule, slot) key in `schedule_slots` makes its late claim fail.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import uuid

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from preheat.history.db import utcnow
from preheat.history.models import BeatLease

log = logging.getLogger(__name__)

BEAT_LEASE = "beat"


def holder_id() -> str:
    """This process, as the lease names it: host, pid and a nonce (pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def hold(session: Session, holder: str, lease_s: float, now: dt.datetime | None = None, name: str = BEAT_LEASE) -> bool:
    """Take the lease if it is free or expired, renew it if `holder` has it; True if held."""
    now = now or utcnow()
    expires = now + dt.timedelta(seconds=lease_s)
    renewed = session.execute(
        update(BeatLease).where(BeatLease.name == name, BeatLease.holder == holder).values(expires_at=expires)
    ).rowcount
    if renewed:
        return True
    taken = session.execute(
        update(BeatLease)
        .where(BeatLease.name == name, BeatLease.expires_at < now)
        .values(holder=holder, acquired_at=now, expires_at=expires)
    ).rowcount
    if taken:
        log.info("beat %s took the lead", holder)
        return True
    if session.scalars(select(BeatLease.id).where(BeatLease.name == name)).first() is not None:
        return False
    try:
        with session.begin_nested():
            session.add(BeatLease(name=name, holder=holder, acquired_at=now, expires_at=expires))
    except IntegrityError:  # another beat created it first
        return False
    return True


def release(session: Session, holder: str, name: str = BEAT_LEASE) -> None:
    """Give the lease up (a clean stop): a standby takes over at its next tick."""
    session.execute(
        update(BeatLease)
        .where(BeatLease.name == name, BeatLease.holder == holder)
        .values(expires_at=utcnow() - dt.timedelta(seconds=1))
    )


def current(session: Session, name: str = BEAT_LEASE) -> BeatLease | None:
    return session.scalars(select(BeatLease).where(BeatLease.name == name)).first()
