"""Cron in a schedule's own time zone: weekdays, day-of-month/day-of-week, and daylight saving
changes treated as Vixie cron treats them."""

import datetime as dt
from zoneinfo import ZoneInfo

import pytest

from preheat.core.cron import Cron, CronError

UTC = dt.UTC
BERLIN, NEW_YORK = "Europe/Berlin", "America/New_York"


def local(timezone: str, *fields: int) -> dt.datetime:
    return dt.datetime(*fields, tzinfo=ZoneInfo(timezone))


def walls(cron: Cron, after: dt.datetime, until: dt.datetime) -> list[str]:
    return [f"{slot.astimezone(cron.tz):%a %Y-%m-%d %H:%M %Z}" for slot in cron.slots(after, until)]


def test_weekday_mornings_in_the_schedules_own_zone():
    cron = Cron.parse("0 9 * * mon-fri", BERLIN)
    # Thursday 2026-11-26 to Wednesday 2026-12-02: no Saturday or Sunday.
    assert walls(cron, local(BERLIN, 2026, 11, 26, 0, 0), local(BERLIN, 2026, 12, 2, 23, 0)) == [
        "Thu 2026-11-26 09:00 CET",
        "Fri 2026-11-27 09:00 CET",
        "Mon 2026-11-30 09:00 CET",
        "Tue 2026-12-01 09:00 CET",
        "Wed 2026-12-02 09:00 CET",
    ]
    # The same wall time in another zone is another instant.
    assert cron.next_after(dt.datetime(2026, 11, 30, tzinfo=UTC)) == dt.datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
    assert Cron.parse("0 9 * * mon-fri", NEW_YORK).next_after(dt.datetime(2026, 11, 30, tzinfo=UTC)) == dt.datetime(
        2026, 11, 30, 14, 0, tzinfo=UTC
    )


def test_slots_are_the_half_open_span_after_until():
    cron = Cron.parse("*/15 * * * *")
    start = dt.datetime(2026, 1, 1, 10, 0, tzinfo=UTC)
    slots = list(cron.slots(start, start + dt.timedelta(hours=1)))
    assert [s.minute for s in slots] == [15, 30, 45, 0] and slots[0] > start


def test_restricted_day_of_month_and_day_of_week_match_either():
    cron = Cron.parse("0 12 1 * fri")  # the 1st, and every Friday, as cron says
    days = [
        slot.day for slot in cron.slots(dt.datetime(2027, 1, 1, tzinfo=UTC), dt.datetime(2027, 1, 31, 23, tzinfo=UTC))
    ]
    assert days == [1, 8, 15, 22, 29]  # 2027-01-01 is a Friday too: one slot, not two
    only_first = Cron.parse("0 12 1 * *")
    assert [
        s.day for s in only_first.slots(dt.datetime(2027, 1, 1, tzinfo=UTC), dt.datetime(2027, 3, 1, 13, tzinfo=UTC))
    ] == [1, 1, 1]


def test_spring_forward_a_fixed_time_in_the_gap_fires_once_at_the_change():
    # New York, 2026-03-08: 02:00 EST becomes 03:00 EDT; 02:30 does not exist that day.
    cron = Cron.parse("30 2 * * *", NEW_YORK)
    assert walls(cron, local(NEW_YORK, 2026, 3, 7, 0, 0), local(NEW_YORK, 2026, 3, 9, 23, 0)) == [
        "Sat 2026-03-07 02:30 EST",
        "Sun 2026-03-08 03:00 EDT",
        "Mon 2026-03-09 02:30 EDT",
    ]
    # Two fixed times in the gap are one slot, at the change.
    both = Cron.parse("0,30 2 * * *", NEW_YORK)
    day = list(both.slots(local(NEW_YORK, 2026, 3, 8, 0, 0), local(NEW_YORK, 2026, 3, 8, 23, 0)))
    assert day == [dt.datetime(2026, 3, 8, 7, 0, tzinfo=UTC)]


def test_spring_forward_a_wildcard_job_follows_the_clock():
    cron = Cron.parse("*/30 * * * *", BERLIN)  # Berlin, 2026-03-29: 02:00 CET becomes 03:00 CEST
    slots = walls(cron, local(BERLIN, 2026, 3, 29, 1, 0), local(BERLIN, 2026, 3, 29, 4, 0))
    assert slots == [
        "Sun 2026-03-29 01:30 CET",
        "Sun 2026-03-29 03:00 CEST",
        "Sun 2026-03-29 03:30 CEST",
        "Sun 2026-03-29 04:00 CEST",
    ]
    gaps = {
        b - a
        for a, b in zip(
            cron.slots(local(BERLIN, 2026, 3, 29, 0, 0), local(BERLIN, 2026, 3, 29, 6, 0)),
            list(cron.slots(local(BERLIN, 2026, 3, 29, 0, 0), local(BERLIN, 2026, 3, 29, 6, 0)))[1:],
            strict=False,
        )
    }
    assert gaps == {dt.timedelta(minutes=30)}  # in real time, never a double or a hole


def test_fall_back_a_fixed_time_fires_once_the_first_time():
    # New York, 2026-11-01: 02:00 EDT becomes 01:00 EST; 01:30 happens twice.
    cron = Cron.parse("30 1 * * *", NEW_YORK)
    slots = list(cron.slots(local(NEW_YORK, 2026, 11, 1, 0, 0), local(NEW_YORK, 2026, 11, 2, 0, 0)))
    assert slots == [dt.datetime(2026, 11, 1, 5, 30, tzinfo=UTC)]  # 01:30 EDT, not again at 01:30 EST


def test_fall_back_a_wildcard_job_runs_in_the_repeated_hour_again():
    cron = Cron.parse("*/30 1 * * *", NEW_YORK)
    assert walls(cron, local(NEW_YORK, 2026, 11, 1, 0, 0), local(NEW_YORK, 2026, 11, 1, 3, 0)) == [
        "Sun 2026-11-01 01:00 EDT",
        "Sun 2026-11-01 01:30 EDT",
        "Sun 2026-11-01 01:00 EST",
        "Sun 2026-11-01 01:30 EST",
    ]


def test_a_week_across_a_change_keeps_the_local_time():
    cron = Cron.parse("50 8 * * 1-5", BERLIN)
    slots = list(cron.slots(local(BERLIN, 2026, 10, 22, 0, 0), local(BERLIN, 2026, 10, 28, 0, 0)))
    assert [f"{s.astimezone(cron.tz):%H:%M}" for s in slots] == ["08:50"] * 4
    assert [s.hour for s in slots] == [6, 6, 7, 7]  # UTC moves by the hour Berlin changed on Sunday 25th


@pytest.mark.parametrize(
    ("expression", "timezone", "message"),
    [
        ("0 9 * *", "UTC", "must have 5 fields"),
        ("61 * * * *", "UTC", "is invalid"),
        ("0 24 * * *", "UTC", "is invalid"),
        ("0 9 * * funday", "UTC", "is invalid"),
        ("0 0 30 2 *", "UTC", "is invalid"),
        ("\uff15 * * * *", "UTC", "is invalid"),  # a full-width 5: int() would take it, cron does not
        ("*/0 * * * *", "UTC", "is invalid"),
        ("0 9 * * *", "Europe/Atlantis", "unknown time zone"),
        ("0 9 * * *", "../../etc/passwd", "unknown time zone"),
    ],
)
def test_bad_expressions_and_zones_say_why(expression, timezone, message):
    with pytest.raises(CronError, match=message):
        Cron.parse(expression, timezone)


def test_a_short_span_next_to_a_change_still_finds_the_slot_at_the_change():
    # What beat asks each tick: a span of seconds. The wall-clock shortcut must not lose this slot.
    cron = Cron.parse("30 2 * * *", NEW_YORK)
    change = dt.datetime(2026, 3, 8, 7, 0, tzinfo=UTC)
    assert list(cron.slots(change - dt.timedelta(seconds=5), change + dt.timedelta(seconds=5))) == [change]
    assert cron.next_after(change - dt.timedelta(seconds=1)) == change
    every = Cron.parse("* * * * *", BERLIN)
    now = dt.datetime(2026, 11, 30, 8, 0, 30, tzinfo=UTC)
    assert list(every.slots(now, now + dt.timedelta(seconds=40))) == [dt.datetime(2026, 11, 30, 8, 1, tzinfo=UTC)]
