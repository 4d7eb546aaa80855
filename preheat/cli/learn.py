"""Learning from traffic: `preheat traffic import`, `preheat peaks suggest`, `preheat templates rank`."""

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
    from preheat import traffic

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
    apply: bool = typer.Option(False, "--apply", help="Write them as schedules of kind peak."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Find weekly peaks and propose schedules that fire ahead of each by a measured lead time."""
    from preheat.cron import Cron, CronError
    from preheat.errors import ConfigError
    from preheat.prune import check_within_retention
    from schedules import peaks

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
        applied = _apply(session, found, weeks) if apply else []
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "name": s.peak.name,
                        "cron": s.peak.cron,
                        "timezone": s.timezone,
                        "lead_time_s": s.lead.seconds,
                        "templates": s.peak.templates,
                        **s.detail(weeks),
                    }
                    for s in found
                ],
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
    if not apply:
        console.print("--apply writes these as schedules of kind peak")


def _apply(session, found, weeks: int) -> list[str]:
    """Write each suggestion as a peak schedule, replacing an earlier one of the same name."""
    from sqlalchemy import select

    from preheat.errors import ConfigError
    from preheat.models import Schedule, ScheduleKind
    from schedules import store

    written = []
    for s in found:
        existing = session.scalars(select(Schedule).where(Schedule.name == s.peak.name)).first()
        if existing is not None:
            if existing.kind != ScheduleKind.peak:
                raise ConfigError(f"schedule {s.peak.name!r} exists and is not a peak schedule; remove or rename it")
            session.delete(existing)
            session.flush()
        store.add(
            session,
            name=s.peak.name,
            cron=s.peak.cron,
            timezone=s.timezone,
            lead_time_s=s.lead.seconds,
            targets={"templates": s.peak.templates},
            kind=ScheduleKind.peak,
            detail=s.detail(weeks),
        )
        written.append(s.peak.name)
    return written


@templates_app.command("rank")
def rank(
    model: str = typer.Option(None, "--model", "-m"),
    days: int = typer.Option(7, "--days", min=1, max=366, help="Days of traffic to rate."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Order templates by time saved (request rate x measured prefill) and say which fit the cache."""
    from preheat.prune import check_within_retention
    from schedules import peaks

    settings = get_settings()
    check_within_retention(days, settings.history_retention_days, f"--days {days}")
    max_bytes = int(settings.kv_cache_max_bytes * settings.kv_cache_pinned_share)
    max_entries = max(1, int(settings.kv_cache_max_entries * settings.kv_cache_pinned_share))
    with session_scope() as session:
        ranks = peaks.rank(
            session,
            load_catalog(settings.catalog),
            days=days,
            max_bytes=max_bytes,
            max_entries=max_entries,
            model=model,
        )
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
    for header in ("#", "template", "model", "req/h", "prefix tokens", "prefill ms", "saved s/h", "KiB", "fits"):
        table.add_column(header, justify="left" if header in ("template", "model", "fits") else "right")
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
        )
    console.print(table)
