"""`preheat report`: one self-contained HTML file of a time range, with plots.

Everything is inline (SVG drawn here, CSS in the page, no script, no font, no image fetched),
and the page forbids fetching anything (`Content-Security-Policy: default-src 'none'`), so it
opens anywhere, offline, attached to a ticket. Plots, from the history:

1. TTFT cold / warm / bare of each template's warmups over time (the probes' medians);
2. verdicts per worker (warm, degraded, failed, lost, skipped, asleep, awake);
3. schedule fires against the learned peaks and the traffic (requests per minute);
4. requests per minute by the name they asked for: each model and each LoRA adapter;
5. the KV bytes each template's prefix held, as its warmups measured them.
"""

from __future__ import annotations

import datetime as dt
import html
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from preheat.core.states import WHOLE_MODEL, JobStatus
from preheat.history.db import aware
from preheat.history.models import Schedule, ScheduleKind, ScheduleSlot, SlotStatus, TrafficCount, WarmupJob

WIDTH, HEIGHT, PAD = 900, 260, 48
WIDE = 'stroke-width="2"'
NOTHING = f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">nothing recorded in the range</text>'
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
STATUS_COLOURS = {
    "warm": "#2ca02c",
    "degraded": "#ff7f0e",
    "failed": "#d62728",
    "lost": "#8c564b",
    "skipped": "#7f7f7f",
    "asleep": "#1f77b4",
    "awake": "#9467bd",
}


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]  # (unix seconds, value)
    colour: str
    dashed: bool = False
    marker: str = "circle"  # circle | square | triangle: told apart without colour too


# The one comparison a template's TTFT plot exists for: each way a colour, a marker and a dash.
WAYS = {
    "cold": ("cold: full prefill", "#d62728", "square", True),
    "warm": ("warm: from the cached prefix", "#2ca02c", "circle", False),
    "bare": ("bare: no system prompt (the floor)", "#7f7f7f", "triangle", True),
}


@dataclass
class ReportData:
    since: dt.datetime
    until: dt.datetime
    ttft: dict[str, list[Series]] = field(default_factory=dict)  # template -> cold, warm, bare
    verdicts: dict[str, Counter] = field(default_factory=dict)  # worker -> status counts
    traffic: list[tuple[float, float]] = field(default_factory=list)  # requests per minute
    by_name: list[Series] = field(default_factory=list)  # requests per minute per model or adapter
    fires: list[tuple[float, str, str]] = field(default_factory=list)  # (time, schedule, action)
    peaks: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, schedule)
    kv_bytes: list[Series] = field(default_factory=list)
    jobs: int = 0


def gather(session: Session, since: dt.datetime, until: dt.datetime) -> ReportData:
    data = ReportData(since, until)
    jobs = session.scalars(
        select(WarmupJob)
        .where(WarmupJob.finished_at >= since, WarmupJob.finished_at <= until)
        .order_by(WarmupJob.finished_at)
    ).all()
    data.jobs = len(jobs)
    ttft: dict[str, dict[str, list]] = defaultdict(lambda: {"cold": [], "warm": [], "bare": []})
    kv: dict[str, list] = defaultdict(list)
    for job in jobs:
        at = aware(job.finished_at).timestamp()
        data.verdicts.setdefault(job.target, Counter())[str(job.status)] += 1
        if job.template == WHOLE_MODEL or job.status not in (JobStatus.warm, JobStatus.degraded):
            continue
        for way in ("cold", "warm", "bare"):
            if (ms := getattr(job, f"ttft_{way}_ms")) is not None:
                ttft[job.template][way].append((at, ms))
        if job.cache_bytes:
            kv[job.template].append((at, job.cache_bytes / 2**20))
    for template, ways in sorted(ttft.items()):
        data.ttft[template] = [
            Series(name, ways[way], colour, dashed, marker) for way, (name, colour, marker, dashed) in WAYS.items()
        ]
    data.kv_bytes = [
        Series(template, points, COLOURS[i % len(COLOURS)]) for i, (template, points) in enumerate(sorted(kv.items()))
    ]
    per_minute: Counter = Counter()
    per_name: dict[str, Counter] = defaultdict(Counter)  # counted under a model's or an adapter's name
    for row in session.scalars(select(TrafficCount).where(TrafficCount.minute >= since, TrafficCount.minute <= until)):
        at = aware(row.minute).timestamp()
        per_minute[at] += row.requests
        per_name[row.model][at] += row.requests
    data.traffic = sorted(per_minute.items())
    data.by_name = [
        Series(name, sorted(counts.items()), COLOURS[i % len(COLOURS)])
        for i, (name, counts) in enumerate(sorted(per_name.items()))
    ]
    schedules = {s.id: s for s in session.scalars(select(Schedule))}
    for slot in session.scalars(
        select(ScheduleSlot).where(
            ScheduleSlot.fire_at >= since, ScheduleSlot.fire_at <= until, ScheduleSlot.status == SlotStatus.sent
        )
    ):
        schedule = schedules.get(slot.schedule_id)
        action = str(schedule.action) if schedule else "warm"
        data.fires.append((aware(slot.fire_at).timestamp(), slot.schedule_name, action))
        if schedule is not None and schedule.kind == ScheduleKind.peak and schedule.detail.get("ends"):
            start = aware(slot.slot_at)
            hours, minutes = map(int, schedule.detail["ends"].split(":"))
            starts_h, starts_m = map(int, schedule.detail["starts"].split(":"))
            span = ((hours * 60 + minutes) - (starts_h * 60 + starts_m)) % 1440 or 1440
            data.peaks.append((start.timestamp(), (start + dt.timedelta(minutes=span)).timestamp(), slot.schedule_name))
    return data


# Drawing ---------------------------------------------------------------------------------


def _scale(lo: float, hi: float, out_lo: float, out_hi: float):
    span = (hi - lo) or 1.0
    return lambda v: out_lo + (v - lo) / span * (out_hi - out_lo)


def _axes(x0: float, x1: float, ymax: float, unit: str, times: bool = True) -> tuple[list[str], callable, callable]:
    sx = _scale(x0, x1, PAD, WIDTH - 12)
    sy = _scale(0, ymax or 1.0, HEIGHT - 28, 12)
    parts = [
        f'<line x1="{PAD}" y1="{HEIGHT - 28}" x2="{WIDTH - 12}" y2="{HEIGHT - 28}" stroke="#444"/>',
        f'<line x1="{PAD}" y1="12" x2="{PAD}" y2="{HEIGHT - 28}" stroke="#444"/>',
    ]
    for i in range(5):
        value = (ymax or 1.0) * i / 4
        y = sy(value)
        parts.append(f'<line x1="{PAD}" y1="{y:.1f}" x2="{WIDTH - 12}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{PAD - 4}" y="{y + 4:.1f}" text-anchor="end">{value:,.1f}</text>')
    span = x1 - x0
    shown = "%H:%M:%S" if span < 1800 else "%H:%M" if span < 86400 else "%m-%d %H:%M"
    for i in range(5 if times else 0):
        at = x0 + span * i / 4
        label = dt.datetime.fromtimestamp(at, dt.UTC).strftime(shown)
        anchor = ("start", "middle", "middle", "middle", "end")[i]
        parts.append(f'<text x="{sx(at):.1f}" y="{HEIGHT - 10}" text-anchor="{anchor}">{label}</text>')
    parts.append(
        f'<text x="6" y="10" class="unit">{html.escape(unit + (" (UTC on the time axis)" if times else ""))}</text>'
    )
    return parts, sx, sy


def fitted(series: list[Series], x0: float, x1: float) -> tuple[float, float]:
    """The time axis fitted to what is drawn (a few dots after a demo fill the plot, not one
    corner of an hour), at least two minutes wide; the report's range when nothing is."""
    times = [t for s in series for t, _ in s.points]
    if not times:
        return x0, x1
    lo, hi = min(times), max(times)
    margin = max((hi - lo) * 0.05, 60.0)
    return lo - margin, hi + margin


def _marker(shape: str, x: float, y: float, colour: str) -> str:
    if shape == "square":
        return f'<rect class="series" x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="{colour}"/>'
    if shape == "triangle":
        points = f"{x:.1f},{y - 5:.1f} {x - 5:.1f},{y + 4:.1f} {x + 5:.1f},{y + 4:.1f}"
        return f'<polygon class="series" points="{points}" fill="{colour}"/>'
    return f'<circle class="series" cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{colour}"/>'


def _dots(points, sx, sy, colour: str, radius: int) -> list[str]:
    return [
        f'<circle class="series" cx="{sx(t):.1f}" cy="{sy(v):.1f}" r="{radius}" fill="{colour}"/>' for t, v in points
    ]


def _svg(plot_id: str, title: str, parts: list[str], legend: list[tuple]) -> str:
    """The figure, its legend one key per (name, colour[, marker, dashed]) as the plot draws it."""
    keys = "".join(f'<span class="key">{_key(*key)}{html.escape(key[0])}</span>' for key in legend)
    return (
        f'<figure id="{plot_id}"><figcaption>{html.escape(title)}</figcaption>'
        f'<svg class="plot" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{html.escape(title)}">{"".join(parts)}</svg><div class="legend">{keys}</div></figure>'
    )


def _key(name: str, colour: str, marker: str | None = None, dashed: bool = False) -> str:
    """A legend's swatch: a bar of the colour, or the line and marker as drawn."""
    if marker is None:
        return f'<svg width="12" height="12"><rect width="12" height="12" fill="{colour}"/></svg>'
    dash = ' stroke-dasharray="5 4"' if dashed else ""
    line = f'<line x1="1" y1="6" x2="25" y2="6" stroke="{colour}" stroke-width="2"{dash}/>'
    mark = _marker(marker, 13, 6, colour).replace(' class="series"', "")
    return f'<svg width="26" height="12">{line}{mark}</svg>'


def line_plot(plot_id: str, title: str, series: list[Series], x0: float, x1: float, unit: str) -> str:
    x0, x1 = fitted(series, x0, x1)
    ymax = max((v for s in series for _, v in s.points), default=1.0) * 1.15
    parts, sx, sy = _axes(x0, x1, ymax, unit)
    for s in series:
        if not s.points:
            continue
        path = " ".join(f"{sx(t):.1f},{sy(v):.1f}" for t, v in s.points)
        dash = ' stroke-dasharray="5 4"' if s.dashed else ""
        parts.append(
            f'<polyline class="series" points="{path}" fill="none" stroke="{s.colour}" stroke-width="2"{dash}/>'
        )
        parts += [_marker(s.marker, sx(t), sy(v), s.colour) for t, v in s.points]
    if not any(s.points for s in series):
        parts.append(NOTHING)
    return _svg(plot_id, title, parts, [(s.name, s.colour, s.marker, s.dashed) for s in series])


def verdict_plot(plot_id: str, verdicts: dict[str, Counter]) -> str:
    workers = sorted(verdicts)
    ymax = max((sum(c.values()) for c in verdicts.values()), default=1) * 1.1
    parts, _, sy = _axes(0, 1, ymax, "jobs", times=False)
    band = (WIDTH - PAD - 12) / max(1, len(workers))
    for i, worker in enumerate(workers):
        x, base = PAD + i * band + band * 0.15, 0.0
        for status, colour in STATUS_COLOURS.items():
            count = verdicts[worker].get(status, 0)
            if count:
                top = sy(base + count)
                parts.append(
                    f'<rect class="series" x="{x:.1f}" y="{top:.1f}" width="{band * 0.7:.1f}" '
                    f'height="{sy(base) - top:.1f}" fill="{colour}"><title>{html.escape(worker)}: {count} {status}'
                    "</title></rect>"
                )
                base += count
        parts.append(
            f'<text x="{x + band * 0.35:.1f}" y="{HEIGHT - 10}" text-anchor="middle">{html.escape(worker)}</text>'
        )
    if not workers:
        parts.append(NOTHING)
    return _svg(plot_id, "Verdicts per worker", parts, list(STATUS_COLOURS.items()))


def schedule_plot(plot_id: str, data: ReportData, x0: float, x1: float) -> str:
    ymax = max((v for _, v in data.traffic), default=1.0) * 1.2
    parts, sx, sy = _axes(x0, x1, ymax, "requests per minute")
    for start, end, name in data.peaks:
        left, right = sx(max(start, x0)), sx(min(end, x1))
        parts.append(
            f'<rect class="series" x="{left:.1f}" y="12" width="{max(1.0, right - left):.1f}" height="{HEIGHT - 40}" '
            f'fill="#ffdd88" opacity="0.5"><title>learned peak {html.escape(name)}</title></rect>'
        )
    if data.traffic:
        path = " ".join(f"{sx(t):.1f},{sy(v):.1f}" for t, v in data.traffic)
        parts.append(f'<polyline class="series" points="{path}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>')
        parts += [
            f'<circle class="series" cx="{sx(t):.1f}" cy="{sy(v):.1f}" r="2" fill="#1f77b4"/>' for t, v in data.traffic
        ]
    colours = {"warm": "#2ca02c", "wake": "#9467bd", "sleep": "#7f7f7f"}
    for at, name, action in data.fires:
        x, colour = sx(at), colours.get(action, "#d62728")
        parts.append(
            f'<line class="series" x1="{x:.1f}" y1="12" x2="{x:.1f}" y2="{HEIGHT - 28}" stroke="{colour}" '
            f"{WIDE}><title>{html.escape(name)}: {action} fired</title></line>"
        )
    if not (data.traffic or data.fires):
        parts.append(
            f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">nothing recorded in the range</text>'
        )
    legend = [("requests per minute", "#1f77b4"), ("learned peak", "#ffdd88")]
    legend += [(f"{action} fired", colour) for action, colour in colours.items()]
    return _svg(plot_id, "Schedule fires against learned peaks and traffic", parts, legend)


STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:960px}
h1{font-size:20px} figure{margin:24px 0} figcaption{font-weight:600;margin-bottom:4px}
svg text{font:11px system-ui,sans-serif;fill:#444} svg .unit{font-weight:600}
.stat{font-size:18px}
.legend{display:flex;flex-wrap:wrap;gap:12px;font-size:12px}.key i{display:inline-block;width:12px;height:12px;
margin-right:4px;vertical-align:middle}
"""


def render(data: ReportData) -> str:
    x0, x1 = data.since.timestamp(), data.until.timestamp()
    ttft_plots = "".join(
        line_plot(
            f"ttft-{i}", f"TTFT of template {template}: cold, warm (cached prefix) and bare", series, x0, x1, "ms"
        )
        for i, (template, series) in enumerate(sorted(data.ttft.items()))
    ) or line_plot("ttft-0", "TTFT per template: cold, warm and bare", [], x0, x1, "ms")
    body = (
        f"<h1>preheat report</h1><p>{data.since:%Y-%m-%d %H:%M} to {data.until:%Y-%m-%d %H:%M} UTC · "
        f"{data.jobs} job(s) · generated by <code>preheat report</code></p>"
        + ttft_plots
        + verdict_plot("verdicts", data.verdicts)
        + schedule_plot("schedules", data, x0, x1)
        + line_plot(
            "by-name",
            "Requests per minute by model and LoRA adapter (as requests named them)",
            data.by_name,
            x0,
            x1,
            "req/min",
        )
        + line_plot(
            "kv-bytes", "KV bytes of each template's prefix, as its warmups measured", data.kv_bytes, x0, x1, "MiB"
        )
    )
    return page("preheat report", body)


def page(title: str, body: str) -> str:
    """A whole page that fetches nothing: everything inline, and a policy that forbids the rest."""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>{body}</body></html>\n"
    )


# The Grafana dashboard, drawn from a real Prometheus (`preheat dev dashboard-snapshot`) --------------


def draw_dashboard(prometheus: str, panels: list[dict], minutes: int) -> str:
    """Each panel's own queries through Prometheus's query_range, drawn as this module draws:
    time series as lines, stats as their latest value."""
    import time

    import httpx

    until = time.time()
    since = until - minutes * 60
    step = max(5, minutes * 60 // 240)
    figures = []
    with httpx.Client(base_url=prometheus, timeout=30) as client:
        for index, panel in enumerate(panels):
            series = []
            for target in panel["targets"]:
                answer = client.get(
                    "/api/v1/query_range",
                    params={"query": target["expr"], "start": since, "end": until, "step": step},
                ).json()
                if answer.get("status") != "success":
                    raise ValueError(f"panel {panel['title']!r}: {target['expr']}: {answer.get('error')}")
                for i, result in enumerate(answer.get("data", {}).get("result", [])):
                    legend = _legend(target.get("legendFormat") or target["expr"], result["metric"])
                    points = [(float(t), float(v)) for t, v in result["values"] if v not in ("NaN", "+Inf", "-Inf")]
                    series.append(Series(legend, points, COLOURS[(len(series) + i) % len(COLOURS)]))
            unit = (panel.get("fieldConfig", {}).get("defaults", {}) or {}).get("unit", "")
            if panel["type"] == "stat":
                figures.append(_stat(f"panel-{index}", panel["title"], series, unit))
            else:
                figures.append(line_plot(f"panel-{index}", panel["title"], series, since, until, unit))
    source = html.escape(prometheus)
    heading = f"<h1>preheat fleet (deploy/grafana/preheat-fleet.json)</h1><p>the last {minutes} min, from {source}</p>"
    return page("preheat fleet dashboard", heading + "".join(figures))


def _legend(template: str, labels: dict) -> str:
    return re.sub(r"{{\s*(\w+)\s*}}", lambda m: labels.get(m.group(1), ""), template)


def _stat(plot_id: str, title: str, series: list[Series], unit: str) -> str:
    values = " · ".join(
        f"{html.escape(s.name)}: <b>{s.points[-1][1]:,.1f}</b>{' ' + unit if unit and unit != 'short' else ''}"
        for s in series
        if s.points
    )
    caption = f"<figcaption>{html.escape(title)}</figcaption>"
    return f'<figure id="{plot_id}">{caption}<p class="stat">{values or "-"}</p></figure>'
