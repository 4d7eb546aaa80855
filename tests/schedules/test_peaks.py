"""Peaks learned from traffic: synthetic weeks with known peaks, imported as CSV; suggested
schedules at those peaks with lead times from recorded warmup durations; templates ranked
by time saved against the cache budget."""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import select

from preheat.history.db import session_scope
from preheat.history.models import (
    JobStatus,
    RunStatus,
    Schedule,
    ScheduleKind,
    TargetKind,
    TrafficCount,
    TriggerKind,
    WarmupJob,
    WarmupRun,
)
from preheat.schedules.peaks import _days_field, find_peaks, p95
from tests.conftest import write_catalog

BERLIN = ZoneInfo("Europe/Berlin")
START = dt.datetime(2026, 11, 2, tzinfo=BERLIN)  # a Monday; three weeks, no clock change
WEEKS = 3
EXTRA_TEMPLATES = (
    '\n[templates.summarise]\nmodel = "tiny"\nsystem_prompt = "Summarise in five bullets."\n'
    '\n[templates.code]\nmodel = "tiny"\nsystem_prompt = "You review Python code."\n'
)


def synthetic_minutes():
    """(UTC minute, support, summarise) per minute: 2 requests/min all week; weekdays 09:00-10:00
    Berlin time 40 support + 20 summarise; Saturdays 20:00-21:00 30 support."""
    minute = START
    while minute < START + dt.timedelta(weeks=WEEKS):
        weekday, hour = minute.isoweekday(), minute.hour  # in Berlin
        support, summarise = 2, 0
        if weekday <= 5 and hour == 9:
            support, summarise = 40, 20
        elif weekday == 6 and hour == 20:
            support = 30
        yield minute.astimezone(dt.UTC), support, summarise
        minute = (minute.astimezone(dt.UTC) + dt.timedelta(minutes=1)).astimezone(BERLIN)


def write_csv(path):
    with path.open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(["minute", "model", "template", "requests", "prompt_tokens", "prefix_tokens"])
        for minute, support, summarise in synthetic_minutes():
            stamp = minute.strftime("%Y-%m-%dT%H:%MZ")
            out.writerow([stamp, "tiny", "support", support, support * 90, 70])
            if summarise:
                out.writerow([stamp, "tiny", "summarise", summarise, summarise * 40, 12])
    return path


def record_warmups(durations_s: list[float], measured: dict[str, tuple[float, int]]) -> None:
    """Finished runs of model tiny with these durations, and warm jobs with these measurements."""
    base = dt.datetime(2026, 11, 20, 8, 0, tzinfo=dt.UTC)
    with session_scope() as session:
        for index, duration in enumerate(durations_s):
            created = base + dt.timedelta(hours=index)
            run = WarmupRun(
                trigger=TriggerKind.schedule,
                requested_by="test",
                status=RunStatus.succeeded,
                created_at=created,
                finished_at=created + dt.timedelta(seconds=duration),
            )
            for template, (prefill_ms, cache_bytes) in measured.items():
                run.jobs.append(
                    WarmupJob(
                        target="gpu0@a",
                        model="tiny",
                        template=template,
                        status=JobStatus.warm,
                        target_kind=TargetKind.worker,
                        prefill_ms=prefill_ms,
                        cache_bytes=cache_bytes,
                        cached_tokens=50,
                        finished_at=created + dt.timedelta(seconds=duration),
                    )
                )
            session.add(run)


@pytest.fixture
def learned(services_stack, tmp_path, tiny_model):
    stack = services_stack  # the SQLite upsert is covered by the worker's own traffic counts
    write_catalog(tmp_path, tiny_model, EXTRA_TEMPLATES)  # the stack's catalog path, rewritten
    imported = stack.cli("traffic", "import", str(write_csv(tmp_path / "traffic.csv")))
    assert imported.returncode == 0, imported.stderr
    assert "imported 31,140 row(s)" in imported.stdout
    # Twenty recorded warmups of 10 … 29 s: p95 (nearest rank) is 28 s.
    record_warmups(
        [10.0 + i for i in range(20)],
        {"support": (30.0, 200 * 1024), "summarise": (20.0, 150 * 1024), "code": (50.0, 300 * 1024)},
    )
    return stack


def test_peaks_suggest_finds_the_known_peaks_with_lead_times_from_recorded_warmups(learned):
    stack = learned
    suggested = stack.cli("peaks", "suggest", "--tz", "Europe/Berlin", "--weeks", "3", "--margin-s", "60", "--json")
    assert suggested.returncode == 0, suggested.stderr
    found = {s["name"]: s for s in json.loads(suggested.stdout)}
    assert sorted(found) == ["peak-tiny-mon-fri-0900", "peak-tiny-sat-2000"]
    weekday, saturday = found["peak-tiny-mon-fri-0900"], found["peak-tiny-sat-2000"]
    assert (weekday["cron"], weekday["timezone"], weekday["starts"], weekday["ends"]) == (
        "0 9 * * 1-5",
        "Europe/Berlin",
        "09:00",
        "10:00",
    )
    assert (saturday["cron"], saturday["starts"], saturday["ends"]) == ("0 20 * * 6", "20:00", "21:00")
    assert weekday["templates"] == ["summarise", "support"] and saturday["templates"] == ["support"]
    assert weekday["peak_rpm"] == 60.0 and saturday["peak_rpm"] == 30.0
    for suggestion in (weekday, saturday):
        assert suggestion["lead"] == {"seconds": math.ceil(28.0 + 60), "p95_s": 28.0, "margin_s": 60.0, "runs": 20}
        assert suggestion["lead_time_s"] == 88

    applied = stack.cli("peaks", "suggest", "--tz", "Europe/Berlin", "--weeks", "3", "--apply")
    assert applied.returncode == 0 and "(written)" in applied.stdout, applied.stderr
    assert stack.cli("peaks", "suggest", "--tz", "Europe/Berlin", "--weeks", "3", "--apply").returncode == 0
    with session_scope() as session:
        schedules = {s.name: s for s in session.scalars(select(Schedule))}
    assert sorted(schedules) == sorted(found)  # applied twice: replaced, not doubled
    weekday_schedule = schedules["peak-tiny-mon-fri-0900"]
    assert (weekday_schedule.kind, weekday_schedule.cron, weekday_schedule.lead_time_s) == (
        ScheduleKind.peak,
        "0 9 * * 1-5",
        88,
    )
    assert weekday_schedule.targets == {"templates": ["summarise", "support"]}
    assert weekday_schedule.detail["days"] == ["mon", "tue", "wed", "thu", "fri"]


def test_peaks_suggest_sleeps_between_the_peaks_and_wakes_the_model_by_its_lead(learned):
    stack = learned
    args = ("peaks", "suggest", "--tz", "Europe/Berlin", "--weeks", "3", "--sleep-between", "--sleep-level", "2")
    suggested = stack.cli(*args, "--json")
    assert suggested.returncode == 0, suggested.stderr
    found = {s["name"]: s for s in json.loads(suggested.stdout)}
    assert sorted(found) == [
        "peak-tiny-mon-fri-0900",
        "peak-tiny-sat-2000",
        "sleep-tiny-mon-fri-1000",
        "sleep-tiny-sat-2100",
    ]
    assert {found[name]["action"] for name in ("peak-tiny-mon-fri-0900", "peak-tiny-sat-2000")} == {"wake"}
    weekday, saturday = found["sleep-tiny-mon-fri-1000"], found["sleep-tiny-sat-2100"]
    assert (weekday["cron"], weekday["sleep_level"], weekday["action"]) == ("0 10 * * 1-5", 2, "sleep")
    # Monday to Thursday: asleep from 10:00 until the next day's wake at 09:00 less the 88 s lead.
    assert weekday["shortest_sleep_s"] == 23 * 3600 - 88 // 60 * 60 and weekday["until_wake_of"]
    assert (saturday["cron"], saturday["until_wake_of"]) == ("0 21 * * 6", "peak-tiny-mon-fri-0900")

    assert stack.cli(*args, "--apply").returncode == 0
    with session_scope() as session:
        schedules = {s.name: (str(s.action), s.sleep_level, s.targets) for s in session.scalars(select(Schedule))}
    assert schedules["peak-tiny-mon-fri-0900"] == ("wake", None, {"models": ["tiny"]})
    assert schedules["sleep-tiny-sat-2100"] == ("sleep", 2, {"models": ["tiny"]})
    # Short gaps are not worth a wake: none proposed when every gap is shorter than asked.
    none = stack.cli(*args, "--min-sleep-h", "72", "--json")
    assert [s["action"] for s in json.loads(none.stdout)] == ["warm", "warm"]


def test_templates_rank_by_time_saved_and_fit_the_pinned_budget(learned):
    stack = learned
    stack.env.update(PREHEAT_KV_CACHE_MAX_BYTES="800KiB", PREHEAT_KV_CACHE_PINNED_SHARE="0.5")  # 400 KiB pinned
    ranked = stack.cli("templates", "rank", "--days", "21", "--json")
    assert ranked.returncode == 0, ranked.stderr
    rows = json.loads(ranked.stdout)
    assert [r["template"] for r in rows] == ["support", "summarise", "code"]
    minutes = list(synthetic_minutes())
    hours = 21 * 24
    support_rate = sum(m[1] for m in minutes) / hours
    summarise_rate = sum(m[2] for m in minutes) / hours
    assert rows[0]["requests_per_hour"] == pytest.approx(support_rate, rel=1e-3)
    assert rows[0]["saved_s_per_hour"] == pytest.approx(support_rate * 30.0 / 1000, rel=1e-3)
    assert rows[1]["saved_s_per_hour"] == pytest.approx(summarise_rate * 20.0 / 1000, rel=1e-3)
    assert (rows[0]["prefix_tokens"], rows[1]["prefix_tokens"]) == (70, 12)
    assert [r["fits"] for r in rows] == [True, True, False]  # 200 + 150 KiB fit in 400; code's 300 does not
    assert rows[2]["requests_per_hour"] == 0 and rows[2]["in_catalog"]
    table = stack.cli("templates", "rank", "--days", "21")
    assert "over budget" in table.stdout and "support" in table.stdout


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("minute,model,requests\n2026-11-30T09:00Z,tiny,abc\n", "line 3: requests 'abc' is not a whole number"),
        ("minute,model,requests\n2026-11-30T09:00,tiny,3\n", "has no time zone"),
        ("minute,model,requests\nyesterday,tiny,3\n", "is not an ISO 8601 time"),
        ("minute,model,requests\n2026-11-30T09:00Z,tiny,-3\n", "is not a whole number"),
        ("minute,model,requests\n2026-11-30T09:00Z,ti ny,3\n", "model 'ti ny' is not a name"),
        ("minute,model\n2026-11-30T09:00Z,tiny\n", "missing requests"),
        ("minute,model,requests,colour\n2026-11-30T09:00Z,tiny,1,red\n", "unknown column(s) colour"),
        ("minute,model,requests\n2026-11-30T09:00Z,tiny,1\n2026-11-30T09:00:30Z,tiny,2\n", "a second row"),
    ],
)
def test_a_bad_traffic_file_is_refused_with_its_line_and_nothing_is_written(embedded_stack, tmp_path, content, message):
    path = tmp_path / "traffic.csv"
    path.write_text(
        "minute,model,requests\n2026-11-29T09:00Z,tiny,5\n" + content.split("\n", 1)[1]
        if content.startswith("minute,model,requests\n")
        else content
    )
    result = embedded_stack.cli_here("traffic", "import", str(path))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    with session_scope() as session:  # not even the good first row
        assert session.scalars(select(TrafficCount)).first() is None


def test_non_utf8_and_missing_files_are_one_line(embedded_stack, tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("minute,model,requests\n2026-11-30T09:00Z,caf\xe9,1\n".encode("latin-1"))
    result = embedded_stack.cli_here("traffic", "import", str(path))
    assert result.returncode == 2 and "not UTF-8" in result.stderr
    missing = embedded_stack.cli_here("traffic", "import", str(tmp_path / "nope.csv"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_peak_finding_on_a_week_of_buckets():
    rates = [1.0] * 672  # 15-minute buckets, Sunday 00:00 first
    for day in (1, 2, 3):  # Monday to Wednesday 08:30-09:30
        for bucket in range(day * 96 + 34, day * 96 + 38):
            rates[bucket] = 10.0
    rates[671] = rates[0] = 8.0  # one across Saturday to Sunday midnight
    peaks = find_peaks("m", rates, 15, factor=2.0)
    assert [(p.start, p.end, p.days) for p in peaks] == [("08:30", "09:30", [1, 2, 3]), ("23:45", "00:15", [6])]
    assert _days_field([1, 2, 3, 5]) == "1-3,5" and _days_field([0, 6], names=True) == "sun,sat"
    assert _days_field(list(range(7))) == "*"
    assert p95([10.0 + i for i in range(20)]) == 28.0 and p95([5.0]) == 5.0


ADAPTER_CATALOG = (
    '\n[models.tiny.adapters]\nacme = "adapters/acme"\nbare = "adapters/bare"\n'
    '\n[templates.support-acme]\nmodel = "tiny"\nadapter = "acme"\nsystem_prompt = "You answer for Acme."\n'
)


def adapter_traffic(path):
    """One week from Monday 2026-11-02, Berlin time, weekdays only: the base's support template
    at 09:00-10:00, adapter acme's template at 14:00-15:00, adapter bare (no template) at
    18:00-19:00; nothing else. The adapters' counts are under their names, as workers count them."""
    with path.open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(["minute", "model", "template", "requests"])
        for day in range(5):
            for hour, model, template in ((9, "tiny", "support"), (14, "acme", "support-acme"), (18, "bare", "")):
                for minute in range(60):
                    at = (START + dt.timedelta(days=day, hours=hour, minutes=minute)).astimezone(dt.UTC)
                    out.writerow([at.strftime("%Y-%m-%dT%H:%MZ"), model, template, 20])
    return path


def test_an_adapters_peak_warms_its_templates_and_its_base_sleeps_only_between_all_of_their_peaks(
    services_stack, tmp_path, tiny_model
):
    stack = services_stack
    write_catalog(tmp_path, tiny_model, ADAPTER_CATALOG)
    assert stack.cli("traffic", "import", str(adapter_traffic(tmp_path / "traffic.csv"))).returncode == 0
    args = ("peaks", "suggest", "--tz", "Europe/Berlin", "--weeks", "1", "--default-lead-s", "120")
    warmed = {s["name"]: s for s in json.loads(stack.cli(*args, "--json").stdout)}
    # acme's peak pre-fills the template under it; bare has none to pre-fill: no schedule.
    assert sorted(warmed) == ["peak-acme-mon-fri-1400", "peak-tiny-mon-fri-0900"]
    acme = warmed["peak-acme-mon-fri-1400"]
    assert (acme["templates"], acme["base"], acme["action"]) == (["support-acme"], "tiny", "warm")
    assert warmed["peak-tiny-mon-fri-0900"]["templates"] == ["support"]  # the base's own, not acme's
    # The model's template ranks count its adapters' requests too (counted under their names).
    ranked = json.loads(stack.cli("templates", "rank", "--days", "7", "--model", "tiny", "--json").stdout)
    rates = {r["template"]: (r["model"], r["requests_per_hour"]) for r in ranked}
    assert rates["support-acme"] == ("tiny", rates["support"][1]) and rates["support"][1] > 0

    slept = stack.cli(*args, "--sleep-between", "--min-sleep-h", "1", "--json")
    found = {s["name"]: s for s in json.loads(slept.stdout)}
    # The base sleeps after its own peak until acme's wake, and after acme's until the next day.
    assert sorted(found) == [
        "peak-acme-mon-fri-1400",
        "peak-tiny-mon-fri-0900",
        "sleep-tiny-mon-fri-1000",
        "sleep-tiny-mon-fri-1500",
    ]
    assert found["sleep-tiny-mon-fri-1000"]["until_wake_of"] == "peak-acme-mon-fri-1400"
    assert found["peak-acme-mon-fri-1400"]["action"] == "wake"
    assert stack.cli(*args, "--sleep-between", "--min-sleep-h", "1", "--apply").returncode == 0
    with session_scope() as session:
        schedules = {s.name: (str(s.action), s.targets) for s in session.scalars(select(Schedule))}
    assert schedules["peak-acme-mon-fri-1400"] == ("wake", {"models": ["tiny"]})  # a wake warms acme's template
    assert schedules["sleep-tiny-mon-fri-1500"] == ("sleep", {"models": ["tiny"]})
