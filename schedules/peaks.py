"""Learned peaks and template ranks, from the traffic counts and the warmup history.

`suggest`: fold the last weeks of a model's traffic onto one week of buckets in a time
zone, find where the rate rises to `factor` times the week's mean, and propose a schedule
per start time that fires ahead of it by a lead time measured from history: the p95 of
how long this model's warmups took (dispatch to the last job finished), plus a margin.

`rank` (preheat.fleet.placement, which spreads templates across workers by it): order templates
by the time pre-filling saves, request rate × measured prefill time.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
from dataclasses import dataclass, field
from zoneinfo import ZoneInfo

from sqlalchemy import select
from sqlalchemy.orm import Session

from preheat.core.catalog import Catalog
from preheat.core.errors import UnknownNameError
from preheat.fleet import traffic
from preheat.history.db import aware
from preheat.history.models import RunAction, RunStatus, TargetKind, WarmupJob, WarmupRun

DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")  # cron's numbering: 0 is Sunday
MINUTES_PER_WEEK = 7 * 24 * 60


@dataclass(frozen=True)
class LeadTime:
    seconds: int
    p95_s: float | None  # of the recorded warmup durations; None when there were none
    margin_s: float
    runs: int

    def explain(self) -> str:
        if self.p95_s is None:
            return f"no recorded warmups of this model: default {self.seconds} s"
        return f"p95 {self.p95_s:.1f} s of {self.runs} warmup(s) + margin {self.margin_s:g} s"


@dataclass
class Peak:
    model: str  # what the traffic named: a model, or one of its LoRA adapters
    days: list[int]  # cron weekday numbers, 0 = Sunday
    start: str  # local HH:MM the rate first reaches the threshold
    end: str  # local HH:MM it falls below it again
    peak_rpm: float  # the highest bucket's requests per minute
    baseline_rpm: float  # the week's mean
    templates: list[str] = field(default_factory=list)
    base: str = ""  # the model that sleeps and wakes: `model`, or the adapter's base

    def __post_init__(self) -> None:
        self.base = self.base or self.model

    @property
    def cron(self) -> str:
        return _weekly_cron(self.start, self.days)

    @property
    def name(self) -> str:
        return _weekly_name("peak", self.model, self.days, self.start)


@dataclass
class Suggestion:
    peak: Peak
    timezone: str
    lead: LeadTime

    def detail(self, weeks: int) -> dict:
        return {
            "model": self.peak.model,
            **({"base": self.peak.base} if self.peak.base != self.peak.model else {}),
            "days": [DAY_NAMES[d] for d in self.peak.days],
            "starts": self.peak.start,
            "ends": self.peak.end,
            "peak_rpm": round(self.peak.peak_rpm, 2),
            "baseline_rpm": round(self.peak.baseline_rpm, 2),
            "weeks": weeks,
            "lead": {
                "seconds": self.lead.seconds,
                "p95_s": self.lead.p95_s,
                "margin_s": self.lead.margin_s,
                "runs": self.lead.runs,
            },
        }


@dataclass
class SleepWindow:
    """Off-peak: the model asleep from a peak's end until the wake ahead of its next peak (its
    own, or one of its adapters')."""

    model: str
    days: list[int]  # cron weekday numbers of the peaks it follows
    start: str  # local HH:MM: the peak's end
    shortest_s: int  # the shortest time asleep before the next wake fires
    level: int
    next_peak: str  # the peak whose wake ends it (the first such, by name)

    @property
    def cron(self) -> str:
        return _weekly_cron(self.start, self.days)

    @property
    def name(self) -> str:
        return _weekly_name("sleep", self.model, self.days, self.start)


def sleep_windows(suggestions: list[Suggestion], *, min_sleep_s: int, level: int) -> list[SleepWindow]:
    """Between each peak's end and the next peak's wake (its start less its lead), a sleep,
    where that leaves at least `min_sleep_s` asleep: a short gap is not worth a wake. The
    week is a circle: Saturday's last peak is followed by Sunday's first. A model's adapters'
    peaks are its own: it sleeps only when none of them is near."""
    windows: dict[tuple[str, str], SleepWindow] = {}
    by_model: dict[str, list[Suggestion]] = {}
    for suggestion in suggestions:
        by_model.setdefault(suggestion.peak.base, []).append(suggestion)
    for model, mine in by_model.items():
        onsets = sorted(
            (day * 1440 + _minutes(s.peak.start) - s.lead.seconds // 60, s.peak.name)
            for s in mine
            for day in s.peak.days
        )
        for s in mine:
            for day in s.peak.days:
                start = day * 1440 + _minutes(s.peak.start)
                end = start + ((_minutes(s.peak.end) - _minutes(s.peak.start)) % 1440 or 1440)
                wake_at, next_peak = min(((at if at > end else at + MINUTES_PER_WEEK), name) for at, name in onsets)
                asleep_s = (wake_at - end) * 60
                if asleep_s < min_sleep_s:
                    continue
                end_day, end_text = (end // 1440) % 7, _hhmm(end % 1440)
                window = windows.setdefault(
                    (model, end_text), SleepWindow(model, [], end_text, asleep_s, level, next_peak)
                )
                window.days = sorted({*window.days, end_day})
                window.shortest_s = min(window.shortest_s, asleep_s)
    return sorted(windows.values(), key=lambda w: (w.model, w.start, w.days))


def _minutes(hhmm: str) -> int:
    return int(hhmm[:2]) * 60 + int(hhmm[3:])


def _weekly_cron(start: str, days: list[int]) -> str:
    hour, minute = start.split(":")
    return f"{int(minute)} {int(hour)} * * {_days_field(days)}"


def _weekly_name(kind: str, model: str, days: list[int], start: str) -> str:
    return f"{kind}-{model}-{_days_field(days, names=True)}-{start.replace(':', '')}"[:64]


def _days_field(days: list[int], names: bool = False) -> str:
    """Weekday numbers as a cron field, runs as ranges: [1,2,3,4,5] -> "1-5" (or "mon-fri")."""
    label = (lambda d: DAY_NAMES[d]) if names else str
    parts, run = [], []
    for day in [*sorted(days), None]:
        if run and (day is None or day != run[-1] + 1):
            parts.append(label(run[0]) if len(run) == 1 else f"{label(run[0])}-{label(run[-1])}")
            run = []
        if day is not None:
            run.append(day)
    return ",".join(parts) if len(days) < 7 else "*"


# Peaks -------------------------------------------------------------------------------------


def weekly_rates(rows, timezone: str, bucket_min: int, since: dt.datetime, until: dt.datetime) -> list[float]:
    """Requests per minute in each bucket of the week (Sunday 00:00 local first), averaged over
    the times that bucket occurred between `since` and `until`."""
    zone = ZoneInfo(timezone)
    buckets = MINUTES_PER_WEEK // bucket_min
    totals, occurrences = [0] * buckets, [0] * buckets
    for row in rows:
        totals[_bucket(aware(row.minute), zone, bucket_min)] += row.requests
    minute = since
    while minute <= until:  # count each bucket's minutes in the window, zone changes included
        occurrences[_bucket(minute, zone, bucket_min)] += 1
        minute += dt.timedelta(minutes=1)
    return [total / count if count else 0.0 for total, count in zip(totals, occurrences, strict=False)]


def _bucket(moment: dt.datetime, zone: ZoneInfo, bucket_min: int) -> int:
    local = moment.astimezone(zone)
    minute_of_week = (local.isoweekday() % 7) * 1440 + local.hour * 60 + local.minute
    return minute_of_week // bucket_min


def find_peaks(model: str, rates: list[float], bucket_min: int, factor: float) -> list[Peak]:
    """Runs of buckets at or above `factor` × the week's mean, grouped by start time."""
    mean = statistics.fmean(rates) if rates else 0.0
    threshold = factor * mean
    if mean == 0:
        return []
    count, onsets = len(rates), []
    for index in range(count):
        if rates[index] >= threshold and rates[index - 1] < threshold:  # index - 1 wraps: the week is a circle
            end = index
            while rates[(end + 1) % count] >= threshold and (end + 1) % count != index:
                end += 1
            onsets.append((index, end + 1))
    by_start: dict[str, Peak] = {}
    for start, stop in onsets:
        minute_of_week = start * bucket_min
        day, start_text = minute_of_week // 1440, _hhmm(minute_of_week % 1440)
        end_text = _hhmm((stop * bucket_min) % 1440)
        peak_rpm = max(rates[i % count] for i in range(start, stop))
        peak = by_start.setdefault(start_text, Peak(model, [], start_text, end_text, 0.0, mean))
        peak.days.append(day)
        peak.peak_rpm = max(peak.peak_rpm, peak_rpm)
    return sorted(by_start.values(), key=lambda p: (p.start, p.days))


def _hhmm(minute_of_day: int) -> str:
    return f"{minute_of_day // 60:02d}:{minute_of_day % 60:02d}"


def peak_templates(rows, peak: Peak, zone: ZoneInfo, catalog: Catalog) -> list[str]:
    """The templates requested during the peak (from its start to its end on the peak's days)
    of what the traffic named: a model's own (not under an adapter), or those under the
    adapter; all of them if none are named."""
    adapter = peak.model if peak.model != peak.base else None
    known = {name for name in catalog.templates_of(peak.base) if catalog.templates[name].adapter == adapter}
    seen = set()
    start_minute = int(peak.start[:2]) * 60 + int(peak.start[3:])
    span = (int(peak.end[:2]) * 60 + int(peak.end[3:]) - start_minute) % 1440 or 1440
    for row in rows:
        local = aware(row.minute).astimezone(zone)
        if (
            local.isoweekday() % 7 in peak.days
            and row.template in known
            and 0 <= local.hour * 60 + local.minute - start_minute < span
        ):
            seen.add(row.template)
    return sorted(seen) or sorted(known)


def warmup_durations(session: Session, model: str, limit: int = 200) -> list[float]:
    """Seconds from dispatch to the last job finished, of this model's recent finished warms
    and wakes on workers."""
    query = (
        select(WarmupRun.created_at, WarmupRun.finished_at)
        .join(WarmupJob)
        .where(
            WarmupJob.model == model,
            WarmupJob.target_kind == TargetKind.worker,
            WarmupRun.status.in_([RunStatus.succeeded, RunStatus.degraded]),
            WarmupRun.action != RunAction.sleep,  # warms and wakes: what a peak's lead must cover
            WarmupRun.finished_at.is_not(None),
        )
        .group_by(WarmupRun.id, WarmupRun.created_at, WarmupRun.finished_at)
        .order_by(WarmupRun.created_at.desc())
        .limit(limit)
    )
    return [(aware(finished) - aware(created)).total_seconds() for created, finished in session.execute(query)]


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def lead_time(session: Session, model: str, margin_s: float, default_s: int) -> LeadTime:
    durations = warmup_durations(session, model)
    if not durations:
        return LeadTime(default_s, None, margin_s, 0)
    percentile = p95(durations)
    return LeadTime(math.ceil(percentile + margin_s), round(percentile, 3), margin_s, len(durations))


def suggest(
    session: Session,
    catalog: Catalog,
    *,
    model: str | None,
    timezone: str,
    weeks: int,
    bucket_min: int,
    factor: float,
    margin_s: float,
    default_lead_s: int,
) -> list[Suggestion]:
    suggestions = []
    zone = ZoneInfo(timezone)
    for name in [model] if model else traffic.models(session):
        until = traffic.latest_minute(session, name)
        if until is None:
            continue
        base = _base_of(catalog, name)
        since = until - dt.timedelta(weeks=weeks) + dt.timedelta(minutes=1)
        rows = traffic.counts(session, name, since, until)
        lead = lead_time(session, base, margin_s, default_lead_s)  # an adapter warms with its base
        for peak in find_peaks(name, weekly_rates(rows, timezone, bucket_min, since, until), bucket_min, factor):
            peak.base = base
            peak.templates = peak_templates(rows, peak, zone, catalog)
            if base != name and not peak.templates:
                continue  # an adapter no template names: nothing to pre-fill ahead; read on demand
            suggestions.append(Suggestion(peak, timezone, lead))
    return suggestions


def _base_of(catalog: Catalog, name: str) -> str:
    """The model behind a traffic name: itself, or an adapter's base (a name the catalog no
    longer has counts as a model of its own)."""
    try:
        return catalog.base_and_adapter(name)[0]
    except UnknownNameError:
        return name
