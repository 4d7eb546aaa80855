"""Cron expressions in a schedule's own time zone, as instants: which slots fall in a span.

Celery's ``crontab`` reads every entry in the app's one time zone; a schedule here has its
own (a peak at 09:00 in Berlin and one at 09:00 in New York). The five fields are parsed
by Celery's parser, so the syntax is Celery's (names, ranges, steps); slots are found on
the local wall clock and turned into UTC instants the way Vixie cron treats daylight
saving changes:

- a fixed-time job (its minute and hour fields do not start with ``*``) whose wall time
  does not exist (clocks spring forward) fires once, at the instant the clocks change;
  one whose wall time happens twice (clocks fall back) fires once, the first time;
- a wildcard job (``*`` or ``*/n`` in minute or hour) follows the clock: times that do
  not exist are skipped, a repeated hour runs again.

Day of month and day of week combine as in cron: when both are restricted, a day matches
if either does.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

UTC = dt.UTC
_MINUTE, _HOUR = dt.timedelta(minutes=1), dt.timedelta(hours=1)
_MARGIN = dt.timedelta(hours=3)  # more than any zone's offset change
_DAY, _STEADY_SPAN = dt.timedelta(days=1), dt.timedelta(days=20)
# A cron that matches no day in this many years never fires (e.g. "0 0 30 2 *").
_SEARCH_YEARS = 5


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
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days_of_month: frozenset[int]
    months: frozenset[int]
    days_of_week: frozenset[int]  # 0 = Sunday, as in cron
    day_of_month_restricted: bool
    day_of_week_restricted: bool
    wildcard_time: bool  # minute or hour starts with '*': follows the clock through DST changes

    @classmethod
    def parse(cls, expression: str, timezone: str = "UTC") -> Cron:
        from celery.schedules import crontab

        fields = expression.split()
        if len(fields) != 5:
            raise CronError(f"cron {expression!r} must have 5 fields (minute hour day-of-month month day-of-week)")
        minute, hour, day_of_month, month, day_of_week = fields
        try:
            parsed = crontab(minute, hour, day_of_week, day_of_month, month)
        except (ValueError, KeyError, TypeError) as exc:
            raise CronError(f"cron {expression!r} is invalid: {exc}") from None
        cron = cls(
            expression=" ".join(fields),
            tz=zone(timezone),
            minutes=tuple(sorted(parsed.minute)),
            hours=tuple(sorted(parsed.hour)),
            days_of_month=frozenset(parsed.day_of_month),
            months=frozenset(parsed.month_of_year),
            days_of_week=frozenset(parsed.day_of_week),
            day_of_month_restricted=not day_of_month.startswith("*"),
            day_of_week_restricted=not day_of_week.startswith("*"),
            wildcard_time=minute.startswith("*") or hour.startswith("*"),
        )
        if cron.next_after(dt.datetime.now(UTC)) is None:
            raise CronError(f"cron {expression!r} never fires (no such day in {_SEARCH_YEARS} years)")
        return cron

    # Days -----------------------------------------------------------------------

    def matches_day(self, day: dt.date) -> bool:
        if day.month not in self.months:
            return False
        by_month_day = day.day in self.days_of_month
        by_week_day = day.isoweekday() % 7 in self.days_of_week
        if self.day_of_month_restricted and self.day_of_week_restricted:
            return by_month_day or by_week_day
        return by_month_day and by_week_day

    # Slots ----------------------------------------------------------------------

    def _instants_of(self, day: dt.date, low: dt.datetime, high: dt.datetime) -> list[dt.datetime]:
        """This day's slots with wall times in [low, high] (naive local), as sorted UTC
        instants, with DST handled as cron does."""
        instants = set()
        for hour in self.hours:
            start = dt.datetime(day.year, day.month, day.day, hour)
            if start + _HOUR < low or start > high:  # whole hours outside the span: skipped unresolved
                continue
            for minute in self.minutes:
                wall = start.replace(minute=minute)
                if low <= wall <= high:
                    instants.update(self._resolve(wall))
        return sorted(instants)

    def _wall_span(self, after: dt.datetime, until: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
        """Local wall-clock bounds of the span: exact (to the minute) when the zone's offset
        is the same a day either side of it, else widened past any offset change."""
        end = until or after
        steady = (
            end - after < _STEADY_SPAN
            and (after - _DAY).astimezone(self.tz).utcoffset() == (end + _DAY).astimezone(self.tz).utcoffset()
        )
        margin = _MINUTE if steady else _MARGIN
        low = after.astimezone(self.tz).replace(tzinfo=None) - margin
        high = dt.datetime.max if until is None else until.astimezone(self.tz).replace(tzinfo=None) + margin
        return low, high

    def _resolve(self, wall: dt.datetime) -> list[dt.datetime]:
        first = wall.replace(tzinfo=self.tz, fold=0).astimezone(UTC)
        second = wall.replace(tzinfo=self.tz, fold=1).astimezone(UTC)
        exists = first.astimezone(self.tz).replace(tzinfo=None) == wall
        if not exists:  # in the gap of a spring-forward change
            return [] if self.wildcard_time else [_change_instant(self.tz, second, first)]
        if first != second and self.wildcard_time:  # a repeated hour, followed by the clock
            return [first, second]
        return [first]

    def slots(self, after: dt.datetime, until: dt.datetime) -> Iterator[dt.datetime]:
        """Slots in (after, until], in order, as UTC instants."""
        low, high = self._wall_span(after, until)
        day, last = low.date(), high.date()
        while day <= last:
            if self.matches_day(day):
                for instant in self._instants_of(day, low, high):
                    if after < instant <= until:
                        yield instant
            day += dt.timedelta(days=1)

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        """The first slot after `after`, or None if there is none within the search horizon."""
        low, high = self._wall_span(after, None)
        day = low.date()
        horizon = day + dt.timedelta(days=366 * _SEARCH_YEARS)
        while day <= horizon:
            if self.matches_day(day):
                for instant in self._instants_of(day, low, high):
                    if instant > after:
                        return instant
            day += dt.timedelta(days=1)
        return None


def _change_instant(tz: ZoneInfo, low: dt.datetime, high: dt.datetime) -> dt.datetime:
    """The instant a spring-forward change happens, between two UTC instants around it:
    the first whole minute at which the zone's offset is the new one."""
    offset_after = high.astimezone(tz).utcoffset()
    instant = low.replace(second=0, microsecond=0)
    while instant < high and instant.astimezone(tz).utcoffset() != offset_after:
        instant += _MINUTE
    return instant
