"""Traffic counts: requests per model, template and minute, what peaks and template ranks are
learned from. Workers count what `preheat.infer` serves and write it with their heartbeat;
`preheat traffic import FILE.csv` loads the history of a system preheat did not serve yet.
"""

from __future__ import annotations

import csv
import datetime as dt
import re
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from preheat.core.catalog import NAME_PATTERN
from preheat.core.errors import ConfigError
from preheat.history import outbox
from preheat.history.models import TrafficCount

UTC = dt.UTC
CSV_COLUMNS = ("minute", "model", "template", "requests", "prompt_tokens", "prefix_tokens")
REQUIRED_COLUMNS = ("minute", "model", "requests")
_CHUNK = 1000


@dataclass(frozen=True)
class Tally:
    minute: dt.datetime
    model: str
    template: str
    requests: int
    prompt_tokens: int = 0
    prefix_tokens: int | None = None


def minute_of(moment: dt.datetime) -> dt.datetime:
    return moment.astimezone(UTC).replace(second=0, microsecond=0)


class TrafficCounter:
    """Requests counted in memory, per minute, model and template; `drain` hands them to
    the writer. A failed write puts them back, so a database outage loses no count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter = Counter()
        self._prompt_tokens: Counter = Counter()
        self._prefix_tokens: dict[tuple, int] = {}

    def count(
        self,
        model: str,
        template: str | None,
        prompt_tokens: int,
        prefix_tokens: int | None = None,
        moment: dt.datetime | None = None,
    ) -> None:
        key = (minute_of(moment or dt.datetime.now(UTC)), model, template or "")
        with self._lock:
            self._requests[key] += 1
            self._prompt_tokens[key] += prompt_tokens
            if prefix_tokens:
                self._prefix_tokens[key] = prefix_tokens

    def drain(self) -> list[Tally]:
        with self._lock:
            tallies = [
                Tally(key[0], key[1], key[2], n, self._prompt_tokens[key], self._prefix_tokens.get(key))
                for key, n in self._requests.items()
            ]
            self._requests.clear()
            self._prompt_tokens.clear()
            self._prefix_tokens.clear()
        return tallies

    def restore(self, tallies: Iterable[Tally]) -> None:
        with self._lock:
            for tally in tallies:
                key = (tally.minute, tally.model, tally.template)
                self._requests[key] += tally.requests
                self._prompt_tokens[key] += tally.prompt_tokens
                if tally.prefix_tokens:
                    self._prefix_tokens[key] = tally.prefix_tokens

    def flush(self, write) -> int:
        """Write what was counted with `write(tallies)`; on failure keep it for the next flush."""
        tallies = self.drain()
        if not tallies:
            return 0
        try:
            write(tallies)
        except BaseException:
            self.restore(tallies)
            raise
        return sum(t.requests for t in tallies)


TRAFFIC = TrafficCounter()  # this process's counts (a worker's preheat.infer)


def flush(counter: TrafficCounter = TRAFFIC) -> int:
    """Add this process's counts to the table (a worker does it with each heartbeat); a
    worker's counts wait in its outbox while the database is away."""

    def write(tallies: list[Tally]) -> None:
        outbox.record(TALLIES, {"tallies": [asdict(t) for t in tallies]})

    return counter.flush(write)


def _apply_tallies(session: Session, payload: dict) -> None:
    record(session, [Tally(**{**t, "minute": dt.datetime.fromisoformat(t["minute"])}) for t in payload["tallies"]])


# Traffic counts as an outbox entry kind (preheat.history.outbox): a worker's counts wait there
# while the database is away.
TALLIES = outbox.EntryKind("traffic", _apply_tallies)
OUTBOX_KINDS = (TALLIES,)


def _upsert(session: Session, rows: list[dict], *, add: bool) -> None:
    """Insert rows; on a (minute, model, template) already there, add to it or replace it."""
    if session.bind.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    statement = insert(TrafficCount)
    excluded = statement.excluded
    updates = (
        {
            "requests": TrafficCount.requests + excluded.requests,
            "prompt_tokens": TrafficCount.prompt_tokens + excluded.prompt_tokens,
            "prefix_tokens": func.coalesce(excluded.prefix_tokens, TrafficCount.prefix_tokens),
        }
        if add
        else {
            "requests": excluded.requests,
            "prompt_tokens": excluded.prompt_tokens,
            "prefix_tokens": excluded.prefix_tokens,
        }
    )
    statement = statement.on_conflict_do_update(index_elements=["minute", "model", "template"], set_=updates)
    for start in range(0, len(rows), _CHUNK):  # one statement, executed many times (batched by the driver)
        session.execute(statement, rows[start : start + _CHUNK])


def record(session: Session, tallies: Iterable[Tally], *, add: bool = True) -> None:
    import uuid

    rows = [
        {
            "id": uuid.uuid4(),
            "minute": t.minute,
            "model": t.model,
            "template": t.template,
            "requests": t.requests,
            "prompt_tokens": t.prompt_tokens,
            "prefix_tokens": t.prefix_tokens,
        }
        for t in tallies
    ]
    if rows:
        _upsert(session, rows, add=add)


# Import ---------------------------------------------------------------------------------


def read_csv(path: Path) -> list[Tally]:
    """Parse and check every row before anything is written; one error names file, line, column."""
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    with handle:
        try:
            return list(_rows(path, csv.DictReader(handle)))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except csv.Error as exc:
            raise ConfigError(f"{path}: not a CSV file ({exc})") from None


def _rows(path: Path, reader: csv.DictReader) -> Iterator[Tally]:
    header = [name.strip() for name in reader.fieldnames or []]
    missing = [name for name in REQUIRED_COLUMNS if name not in header]
    unknown = [name for name in header if name not in CSV_COLUMNS]
    if missing or unknown:
        raise ConfigError(
            f"{path}: the header must name {', '.join(REQUIRED_COLUMNS)} (and may name template, "
            f"prompt_tokens, prefix_tokens); "
            + (f"missing {', '.join(missing)}" if missing else f"unknown column(s) {', '.join(unknown)}")
        )
    reader.fieldnames = header
    seen = set()
    for row in reader:
        where = f"{path} line {reader.line_num}"
        tally = Tally(
            minute=_minute(row.get("minute"), where),
            model=_name(row.get("model"), "model", where),
            template=_name(row.get("template") or "", "template", where, optional=True),
            requests=_count(row.get("requests"), "requests", where),
            prompt_tokens=_count(row.get("prompt_tokens") or "0", "prompt_tokens", where),
            prefix_tokens=_count(row["prefix_tokens"], "prefix_tokens", where)
            if (row.get("prefix_tokens") or "").strip()
            else None,
        )
        key = (tally.minute, tally.model, tally.template)
        if key in seen:
            raise ConfigError(
                f"{where}: a second row for {tally.model}/{tally.template or '-'} at {tally.minute:%Y-%m-%d %H:%M}Z"
            )
        seen.add(key)
        yield tally


def _minute(text: str | None, where: str) -> dt.datetime:
    try:
        moment = dt.datetime.fromisoformat((text or "").strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{where}: minute {text!r} is not an ISO 8601 time (e.g. 2026-11-30T09:00:00Z)") from None
    if moment.tzinfo is None:
        raise ConfigError(f"{where}: minute {text!r} has no time zone (add Z or an offset such as +01:00)")
    return minute_of(moment)


def _name(text: str | None, column: str, where: str, optional: bool = False) -> str:
    text = (text or "").strip()
    if optional and not text:
        return ""
    if not re.match(NAME_PATTERN, text):
        raise ConfigError(f"{where}: {column} {text!r} is not a name (letters, digits, '.', '_', '-')")
    return text


def _count(text: str | None, column: str, where: str) -> int:
    text = (text or "").strip()
    if not text.isdigit() or len(text) > 12:
        raise ConfigError(f"{where}: {column} {text!r} is not a whole number >= 0")
    return int(text)


# Reading ---------------------------------------------------------------------------------


def _named(model: str | list[str]):
    """Rows counted under `model`, or under any of a list of names (a model and its adapters)."""
    return TrafficCount.model == model if isinstance(model, str) else TrafficCount.model.in_(model)


def latest_minute(session: Session, model: str | list[str] | None = None) -> dt.datetime | None:
    query = select(func.max(TrafficCount.minute))
    if model is not None:
        query = query.where(_named(model))
    found = session.scalar(query)
    return None if found is None else (found if found.tzinfo else found.replace(tzinfo=UTC))


def models(session: Session) -> list[str]:
    return list(session.scalars(select(TrafficCount.model).distinct().order_by(TrafficCount.model)))


def counts(
    session: Session, model: str | list[str] | None, since: dt.datetime, until: dt.datetime
) -> list[TrafficCount]:
    query = select(TrafficCount).where(TrafficCount.minute >= since, TrafficCount.minute <= until)
    if model is not None:
        query = query.where(_named(model))
    return list(session.scalars(query.order_by(TrafficCount.minute)))
