"""A worker's pulse through the broker: evidence of life that survives a database outage.

A worker writes its heartbeat row to the database; while the database is away from it (a
partition, a restart) the row goes stale, and a reaper that reads only the row would call
a live worker dead and its finished jobs `lost`. So the heartbeat thread also writes a
pulse to the broker, which every worker needs anyway: a Redis key with a time to live
(`preheat:pulse:<nodename>`), or a file beside the embedded broker's folders. The reaper
asks for it before it calls a worker dead. The pulse also says since when the worker has
been idle, which tells a lost message (a job queued for a worker that sat idle) from a
worker busy with other work. A broker with no pulse here (AMQP) leaves the database row
as the only evidence.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from preheat.core.text import safe_name
from preheat.history.db import aware

log = logging.getLogger(__name__)

PREFIX = "preheat:pulse:"


@dataclass(frozen=True)
class Pulse:
    at: dt.datetime
    idle_since: dt.datetime | None  # None: busy with a task right now
    pending: int = 0  # history writes waiting in its outbox: its record is behind its work
    # What the router reads (preheat.fleet.routing): the models it takes requests for, the
    # templates it holds pinned and warm, its engine's rows running and waiting, and the
    # LoRA adapters resident on it.
    node: str = ""
    serving: tuple[str, ...] = ()
    holds: tuple[str, ...] = ()
    running: int = 0
    waiting: int = 0
    max_running: int = 0
    adapters: tuple[str, ...] = ()

    def fresh(self, now: dt.datetime, dead_after_s: float) -> bool:
        """Sent within `dead_after_s` of `now`: the worker is alive (the one rule the reaper
        and the router both apply)."""
        return now - aware(self.at) <= dt.timedelta(seconds=dead_after_s)

    def as_json(self) -> str:
        return json.dumps(
            {
                "at": self.at.isoformat(),
                "idle_since": _iso(self.idle_since),
                "pending": self.pending,
                "node": self.node,
                "serving": list(self.serving),
                "holds": list(self.holds),
                "running": self.running,
                "waiting": self.waiting,
                "max_running": self.max_running,
                "adapters": list(self.adapters),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Pulse | None:
        try:
            raw = json.loads(text)
            return cls(
                dt.datetime.fromisoformat(raw["at"]),
                _parse(raw.get("idle_since")),
                int(raw.get("pending", 0)),
                str(raw.get("node") or ""),
                tuple(str(m) for m in raw.get("serving") or ()),
                tuple(str(t) for t in raw.get("holds") or ()),
                int(raw.get("running", 0)),
                int(raw.get("waiting", 0)),
                int(raw.get("max_running", 0)),
                tuple(str(a) for a in raw.get("adapters") or ()),
            )
        except (ValueError, KeyError, TypeError):
            return None

    @classmethod
    def from_state(cls, state: dict | None, at: dt.datetime, node: str = "") -> Pulse:
        """The pulse a worker's heartbeat state describes (`idle_since`, the outbox's
        `pending`, what it serves and holds, its engine's load): what the worker sends, and
        what the reaper reads off the database row when the broker has no pulse."""
        state = state or {}
        pending = int((state.get("outbox") or {}).get("pending") or 0)
        engine = state.get("engine") or {}
        adapters = state.get("adapters") or {}
        return cls(
            at,
            _parse(state.get("idle_since")),
            pending,
            node,
            tuple(state.get("serving") or ()),
            tuple((state.get("templates") or {}).get("held") or ()),
            int(engine.get("running") or 0),
            int(engine.get("waiting") or 0),
            int(engine.get("max_running") or 0),
            tuple(sorted(a for slots in adapters.values() for a in (slots or {}).get("resident") or ())),
        )


def write_whole(path: Path, text: str) -> None:
    """`text` in `path`, whole or not at all: a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".partial-")
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.replace(temporary, path)


def _iso(moment: dt.datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def _parse(text) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(text) if isinstance(text, str) and text else None
    except ValueError:
        return None


class RedisPulses:
    def __init__(self, url: str, ttl_s: float) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.ttl_s = max(1, math.ceil(ttl_s))

    def write(self, nodename: str, pulse: Pulse) -> None:
        self.client.set(PREFIX + nodename, pulse.as_json(), ex=self.ttl_s)

    def read(self, nodename: str) -> Pulse | None:
        raw = self.client.get(PREFIX + nodename)
        return Pulse.from_json(raw) if raw else None

    def remove(self, nodename: str) -> None:
        """A worker that stopped: no pulse says it lives, from now on."""
        self.client.delete(PREFIX + nodename)

    def read_all(self) -> dict[str, Pulse]:
        """Every pulse not yet expired, by nodename (a fleet is tens of keys: one SCAN, one MGET)."""
        keys = list(self.client.scan_iter(match=PREFIX + "*", count=1000))
        found = {}
        for key, raw in zip(keys, self.client.mget(keys) if keys else [], strict=True):
            pulse = Pulse.from_json(raw) if raw else None
            if pulse is not None:
                found[pulse.node or key.decode()[len(PREFIX) :]] = pulse
        return found


class FilePulses:
    """The embedded default: one file per worker beside the filesystem broker's folders."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, nodename: str) -> Path:
        return self.folder / (safe_name(nodename) + ".json")

    def write(self, nodename: str, pulse: Pulse) -> None:
        write_whole(self._path(nodename), pulse.as_json())

    def read(self, nodename: str) -> Pulse | None:
        try:
            return Pulse.from_json(self._path(nodename).read_text())
        except OSError:
            return None

    def remove(self, nodename: str) -> None:
        self._path(nodename).unlink(missing_ok=True)

    def read_all(self) -> dict[str, Pulse]:
        """Every pulse file's, by the nodename written in it."""
        found = {}
        for path in self.folder.glob("*.json") if self.folder.is_dir() else ():
            try:
                pulse = Pulse.from_json(path.read_text())
            except OSError:
                continue
            if pulse is not None and pulse.node:
                found[pulse.node] = pulse
        return found


def pulses_for(settings) -> RedisPulses | FilePulses | None:
    """Where this deployment's pulses live, or None for a broker that has none here."""
    broker = settings.broker
    if broker.startswith(("redis://", "rediss://")):
        return RedisPulses(broker, 2 * settings.worker_dead_after_s)
    if settings.is_embedded:
        return FilePulses(settings.broker_folder / "pulse")
    return None


def read_quietly(pulses, nodename: str) -> Pulse | None:
    """A pulse, or None when there is none or the broker cannot be asked right now (then the
    database row is the only evidence, as before)."""
    if pulses is None:
        return None
    try:
        return pulses.read(nodename)
    except Exception as exc:  # the broker away: no evidence either way
        log.info("no pulse of %s from the broker: %s", nodename, exc)
        return None
