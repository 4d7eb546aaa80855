"""Cron expressions in a schedule's own time zone, as instants: which slots fall in a span.

Celery's ``crontab`` reads every entry in the app's one time zone; a schedule here has its
own (a peak at 09:00 in Berlin and one at 09:00 in New York). Matching is cronsim's, which
is modelled on Debian's cron and works on zoneinfo, so daylight saving changes are treated
as Vixie cron treats them:

- a fixed-time job (its minute and hour fields do not start with ``*``) whose wall time
  does not exist (clocks spring forward) fires once, at the instant the clocks change;
  one whose wall time happens twice (clocks fall back) fires once, the first time;
- a wildcard job (``*`` or ``*/n`` in minute or hour) follows the clock: times that do
  not exist are skipped, a repeated hour runs again.

Day of month and day of week combine as in cron: when both are restricted, a day matches
if either does. preheat keeps the slot bookkeeping (which slot was sent, missed, claimed);
this module only says when slots are. ``tests/preheat/test_cron.py`` holds the rules.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

UTC = dt.UTC


class CronError(ValueError):
    """An expression or time zone that cannot be scheduled; the message says why."""


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise CronError(f"unknown time zone {name!r} (an IANA name such as Europe/Berlin)") from None


@dataclass(frozen=True)
class Cron:
    expression: str
    tz: ZoneInfo

    @classmethod
    def parse(cls, expression: str, timezone: str = "UTC") -> Cron:
        fields = expression.split()
        if len(fields) != 5:
            raise CronError(f"cron {expression!r} must have 5 fields (minute hour day-of-month month day-of-week)")
        cron = cls(" ".join(fields), zone(timezone))
        try:
            first = cron.next_after(dt.datetime.now(UTC))
        except CronSimError as exc:
            raise CronError(f"cron {expression!r} is invalid: {exc}") from None
        if first is None:
            raise CronError(f"cron {expression!r} is invalid: it never fires")
        return cron

    def _iterate(self, after: dt.datetime) -> Iterator[dt.datetime]:
        """Slots from `after` on (cronsim starts at the minute after a whole minute), as UTC."""
        for slot in CronSim(self.expression, after.astimezone(self.tz)):
            yield slot.astimezone(UTC)

    def slots(self, after: dt.datetime, until: dt.datetime) -> Iterator[dt.datetime]:
        """Slots in (after, until], in order, as UTC instants."""
        for slot in self._iterate(after):
            if slot > until:
                return
            if slot > after:
                yield slot

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        """The first slot after `after`, or None if there is none."""
        return next((slot for slot in self._iterate(after) if slot > after), None)


@functools.lru_cache(maxsize=256)
def cron_of(expression: str, timezone: str) -> Cron:
    """A stored schedule's cron, parsed once per process (beat asks every tick)."""
    return Cron.parse(expression, timezone)


def fire_time_after(expression: str, timezone: str, lead_time_s: int, after: dt.datetime) -> dt.datetime | None:
    """A schedule's first fire time (cron time − lead) after `after`."""
    lead = dt.timedelta(seconds=lead_time_s)
    slot = cron_of(expression, timezone).next_after(after + lead)
    return None if slot is None else slot - lead
