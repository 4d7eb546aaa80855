"""Learning from traffic: `preheat traffic import`, `peaks suggest`, `templates rank`; `templates plan`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from preheat.cli import render
from preheat.cli.lazy import get_settings, load_catalog, session_scope

traffic_app = typer.Typer(no_args_is_help=True, help="Traffic counts per model, template and minute.")
peaks_app = typer.Typer(no_args_is_help=True, help="Peaks learned from traffic, proposed as schedules.")
templates_app = typer.Typer(no_args_is_help=True, help="Which system prompts are worth pre-filling.")
console = render.console()


@traffic_app.command("import")
def import_(
    path: Path = typer.Argument(..., help="CSV: minute,model,template,requests[,prompt_tokens][,prefix_tokens]."),
    add: bool = typer.Option(False, "--add", help="Add to counts already stored (default: replace them)."),
) -> None:
    """Load traffic history; every row is checked before any is written."""
    from preheat.fleet import traffic

    tallies = traffic.read_csv(path)
    with session_scope() as session:
        traffic.record(session, tallies, add=add)
    if tallies:
        first, last = min(t.minute for t in tallies), max(t.minute for t in tallies)
        console.print(
            f"imported {len(tallies):,} row(s), {sum(t.requests for t in tallies):,} request(s), "
            f"{render.when(first)} to {render.when(last)} UTC, models: "
            f"{', '.join(sorted({t.model for t in tallies}))}"
        )
    else:
        console.print("nothing to import: the file has a header and no rows")


@peaks_app.command("suggest")
def suggest(
    model: str = typer.Option(None, "--model", "-m", help="One model (default: every model with traffic)."),
    timezone: str = typer.Option(
        None, "--tz", "--timezone", help="Zone to find weekly peaks in (default PREHEAT_TIMEZONE)."
    ),
    weeks: int = typer.Option(4, "--weeks", min=1, max=52, help="Weeks of traffic to learn from."),
    bucket_min: int = typer.Option(15, "--bucket-min", min=1, max=240, help="Minutes per bucket (divides a day)."),
    factor: float = typer.Option(2.0, "--factor", min=1.01, help="A peak is a bucket at factor x the week's mean."),
    margin_s: float = typer.Option(60.0, "--margin-s", min=0, help="Added to the p95 warmup duration."),
    default_lead_s: int = typer.Option(
        300, "--default-lead-s", min=0, max=86400, help="Lead time when no warmup of the model is recorded yet."
    ),
    sleep_between: bool = typer.Option(
        False, "--sleep-between", help="Also propose sleeps between peaks; each peak then wakes its model."
    ),
    min_sleep_h: float = typer.Option(2.0, "--min-sleep-h", min=0, max=168, help="Shortest sleep worth proposing."),
    sleep_level: int = typer.Option(1, "--sleep-level", min=1, max=2, help="The proposed sleeps' level."),
    apply: bool = typer.Option(False, "--apply", help="Write them as schedules of kind peak."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Find weekly peaks and propose schedules that fire ahead of each by a measured lead time;
    with --sleep-between, the sleep windows between them too (each peak's schedule then wakes
    the model by its lead: a wake is a warmup)."""
    from preheat.core.cron import Cron, CronError
    from preheat.core.errors import ConfigError
    from preheat.history.prune import check_within_retention
    from preheat.schedules import peaks

    settings = get_settings()
    check_within_retention(7 * weeks, settings.history_retention_days, f"--weeks {weeks}")
    timezone = settings.timezone if timezone is None else timezone
    try:
        Cron.parse("0 0 * * *", timezone)
    except CronError as exc:
        raise ConfigError(str(exc)) from None
    if 1440 % bucket_min:
        raise ConfigError(f"--bucket-min {bucket_min} does not divide a day (1440 minutes)")
    catalog = load_catalog(settings.catalog)
    with session_scope() as session:
        found = peaks.suggest(
            session,
            catalog,
            model=model,
            timezone=timezone,
            weeks=weeks,
            bucket_min=bucket_min,
            factor=factor,
            margin_s=margin_s,
            default_lead_s=default_lead_s,
        )
        windows = (
            peaks.sleep_windows(found, min_sleep_s=round(min_sleep_h * 3600), level=sleep_level)
            if sleep_between
            else []
        )
        applied = _apply(session, found, weeks, windows, catalog) if apply else []
    at_peak = "wake" if windows else "warm"
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "name": s.peak.name,
                        "action": at_peak if any(w.model == s.peak.base for w in windows) else "warm",
                        "cron": s.peak.cron,
                        "timezone": s.timezone,
                        "lead_time_s": s.lead.seconds,
                        "templates": s.peak.templates,
                        **s.detail(weeks),
                    }
                    for s in found
                ]
                + [_window_json(w, timezone) for w in windows],
                indent=2,
            )
        )
        return
    if not found:
        console.print("no peaks found (no traffic counted, or none rises to the factor; see --factor)")
        return
    table = Table(title=f"peaks in {timezone}, last {weeks} week(s)", title_justify="left")
    for header in (
        "model",
        "days",
        "starts",
        "ends",
        "peak req/min",
        "mean req/min",
        "lead s",
        "from",
        "cron",
        "schedule",
    ):
        table.add_column(header, no_wrap=header not in ("from",))
    for s in found:
        table.add_row(
            s.peak.model,
            peaks._days_field(s.peak.days, names=True),
            s.peak.start,
            s.peak.end,
            f"{s.peak.peak_rpm:,.1f}",
            f"{s.peak.baseline_rpm:,.1f}",
            str(s.lead.seconds),
            s.lead.explain(),
            s.peak.cron,
            s.peak.name + (" (written)" if s.peak.name in applied else ""),
        )
    console.print(table)
    if windows:
        console.print(_windows_table(windows, timezone, applied))
    if not apply:
        console.print("--apply writes these as schedules of kind peak")


def _window_json(window, timezone: str) -> dict:
    return {
        "name": window.name,
        "action": "sleep",
        "sleep_level": window.level,
        "cron": window.cron,
        "timezone": timezone,
        "lead_time_s": 0,
        "model": window.model,
        "starts": window.start,
        "shortest_sleep_s": window.shortest_s,
        "until_wake_of": window.next_peak,
    }


def _windows_table(windows, timezone: str, applied: list[str]) -> Table:
    from preheat.schedules import peaks

    table = Table(title=f"sleeps between the peaks, in {timezone}", title_justify="left")
    for header in ("model", "days", "sleeps at", "level", "shortest sleep h", "until the wake of", "cron", "schedule"):
        table.add_column(header, no_wrap=True)
    for w in windows:
        table.add_row(
            w.model,
            peaks._days_field(w.days, names=True),
            w.start,
            str(w.level),
            f"{w.shortest_s / 3600:.1f}",
            w.next_peak,
            w.cron,
            w.name + (" (written)" if w.name in applied else ""),
        )
    return table


def _apply(session, found, weeks: int, windows, catalog) -> list[str]:
    """Write each suggestion as a peak schedule (a wake where its model sleeps between peaks)
    and each sleep window as a sleep schedule, replacing earlier ones of the same names."""
    from preheat.history.models import RunAction, ScheduleKind
    from preheat.schedules import store

    sleeping = {w.model for w in windows}
    for name in [s.peak.name for s in found] + [w.name for w in windows]:
        _replace_peak_schedule(session, name)
    written = []
    for s in found:
        store.add(
            session,
            name=s.peak.name,
            cron=s.peak.cron,
            timezone=s.timezone,
            lead_time_s=s.lead.seconds,
            # A wake of the base warms every template of it, its adapters' too.
            targets={"models": [s.peak.base]} if s.peak.base in sleeping else {"templates": s.peak.templates},
            kind=ScheduleKind.peak,
            detail=s.detail(weeks),
            action=RunAction.wake if s.peak.base in sleeping else RunAction.warm,
            catalog=catalog,
        )
        written.append(s.peak.name)
    for w in windows:
        store.add(
            session,
            name=w.name,
            cron=w.cron,
            timezone=found[0].timezone,
            targets={"models": [w.model]},
            kind=ScheduleKind.peak,
            detail={"model": w.model, "starts": w.start, "until_wake_of": w.next_peak, "shortest_s": w.shortest_s},
            action=RunAction.sleep,
            sleep_level=w.level,
            catalog=catalog,
        )
        written.append(w.name)
    return written


def _replace_peak_schedule(session, name: str) -> None:
    from sqlalchemy import select

    from preheat.core.errors import ConfigError
    from preheat.history.models import Schedule, ScheduleKind

    existing = session.scalars(select(Schedule).where(Schedule.name == name)).first()
    if existing is not None:
        if existing.kind != ScheduleKind.peak:
            raise ConfigError(f"schedule {name!r} exists and is not a peak schedule; remove or rename it")
        session.delete(existing)
        session.flush()


@templates_app.command("rank")
def rank(
    model: str = typer.Option(None, "--model", "-m"),
    days: int = typer.Option(7, "--days", min=1, max=366, help="Days of traffic to rate."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Order templates by time saved (request rate x measured prefill) and say which fit the cache."""
    from preheat.fleet import placement
    from preheat.history.prune import check_within_retention

    settings = get_settings()
    check_within_retention(days, settings.history_retention_days, f"--days {days}")
    max_bytes = int(settings.kv_cache_max_bytes * settings.kv_cache_pinned_share)
    max_entries = max(1, int(settings.kv_cache_max_entries * settings.kv_cache_pinned_share))
    with session_scope() as session:
        ranks = placement.rank(
            session,
            load_catalog(settings.catalog),
            days=days,
            max_bytes=max_bytes,
            max_entries=max_entries,
            model=model,
        )
        held_by = placement.held_by(session, settings.worker_dead_after_s)
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "template": r.template,
                        "model": r.model,
                        "requests_per_hour": round(r.requests_per_hour, 3),
                        "prefix_tokens": r.prefix_tokens,
                        "prefill_ms": r.prefill_ms,
                        "cache_bytes": r.cache_bytes,
                        "saved_s_per_hour": r.saved_s_per_hour,
                        "fits": r.fits,
                        "in_catalog": r.in_catalog,
                        "held_by": held_by.get(r.template, []),
                    }
                    for r in ranks
                ],
                indent=2,
            )
        )
        return
    table = Table(
        title=f"templates by time saved, last {days} day(s)",
        title_justify="left",
        caption=f"pinned budget: {max_entries} entries, {max_bytes / 1024**2:,.1f} MiB "
        f"(PREHEAT_KV_CACHE_* x pinned share)",
        caption_justify="left",
    )
    headers = ("#", "template", "model", "req/h", "prefix tokens", "prefill ms", "saved s/h", "KiB", "fits", "held by")
    for header in headers:
        table.add_column(header, justify="left" if header in ("template", "model", "fits", "held by") else "right")
    for position, r in enumerate(ranks, 1):
        fits = "not measured" if r.fits is None else ("yes" if r.fits else "over budget")
        table.add_row(
            str(position),
            r.template + ("" if r.in_catalog else " (not in catalog)"),
            r.model,
            f"{r.requests_per_hour:,.1f}",
            "-" if r.prefix_tokens is None else str(r.prefix_tokens),
            "-" if r.prefill_ms is None else f"{r.prefill_ms:,.1f}",
            "-" if r.saved_s_per_hour is None else f"{r.saved_s_per_hour:,.2f}",
            "-" if r.cache_bytes is None else f"{r.cache_bytes / 1024:,.0f}",
            fits,
            ", ".join(held_by.get(r.template, [])) or "-",
        )
    console.print(table)


@templates_app.command("plan")
def plan(as_json: bool = typer.Option(False, "--json")) -> None:
    """Where each template is pinned across the live workers (the fleet's plan), and which none holds."""
    from preheat.fleet import placement, registry

    settings = get_settings()
    catalog = load_catalog(settings.catalog)
    with session_scope() as session:
        held_by = placement.held_by(session, settings.worker_dead_after_s)
        shares = {
            record.nodename: ((record.state or {}).get("templates") or {}).get("planned")
            for record in registry.live_workers(session, settings.worker_dead_after_s)
        }
    rows = [
        {
            "template": name,
            "model": catalog.template(name).model,
            "planned_on": sorted(w for w, share in shares.items() if share is None or name in share),
            "held_by": sorted(held_by.get(name, [])),
        }
        for name in catalog.templates
    ]
    if as_json:
        print(json.dumps({"spread": any(share is not None for share in shares.values()), "templates": rows}, indent=2))
        return
    spread = any(share is not None for share in shares.values())
    table = Table(
        title=f"templates across {len(shares)} live worker(s)"
        + (": spread (the catalog does not fit one worker's pinned budget)" if spread else ": pinned on every worker"),
        title_justify="left",
        caption="planned on: the workers whose share it is; held by: pinned and warm there now",
        caption_justify="left",
    )
    for header in ("template", "model", "planned on", "held by"):
        table.add_column(header)
    for row in rows:
        table.add_row(
            row["template"],
            row["model"],
            ", ".join(row["planned_on"]) or "[yellow]none: answered from the LRU part[/]",
            ", ".join(row["held_by"]) or "-",
        )
    console.print(table)
