"""`preheat history`: read the record of warmup runs."""

from __future__ import annotations

import datetime as dt
import json
import re

import typer

from preheat.cli import render
from preheat.cli.lazy import session_scope, utcnow
from preheat.core.errors import ConfigError, UnknownNameError
from preheat.core.states import RunStatus, TriggerKind

console = render.console()
_SPAN = re.compile(r"^(\d+)([mhd])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days"}


def parse_span(value: str) -> dt.timedelta | None:
    """'30m', '6h', '7d' as a timedelta; None when `value` is not such a span. Raises
    OverflowError past what a timedelta holds."""
    match = _SPAN.match(value)
    return dt.timedelta(**{_UNITS[match[2]]: int(match[1])}) if match else None


def parse_since(value: str) -> dt.datetime:
    """'30m', '6h', '7d', or an ISO date/time (UTC when no zone is given)."""
    try:
        span = parse_span(value)
        if span is not None:
            return utcnow() - span
    except OverflowError:
        raise ConfigError(f"--since {value!r} reaches back before year 1") from None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"--since {value!r}: expected e.g. 30m, 6h, 7d or 2026-11-29T08:00") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def history(
    run: str = typer.Argument(None, help="A run id (or its first characters) to show job by job."),
    trigger: TriggerKind = typer.Option(None, help="Only runs with this trigger."),
    status: RunStatus = typer.Option(None, help="Only runs with this status."),
    since: str = typer.Option(None, help="Only runs created since: 30m, 6h, 7d or an ISO time."),
    limit: int = typer.Option(20, min=1, max=1000, help="At most this many runs."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List warmup runs, newest first, or show one run's jobs with their measured timings."""
    from preheat.history import service

    with session_scope() as session:
        if run is not None:
            found = service.find_run(session, run)
            if found is None:
                raise UnknownNameError(f"no run matches {run!r}")
            runs = [found]
        else:
            runs = service.list_runs(
                session, trigger=trigger, status=status, since=parse_since(since) if since else None, limit=limit
            )
    if as_json:
        payload = render.run_json(runs[0]) if run is not None else [render.run_json(r) for r in runs]
        print(json.dumps(payload, indent=2))
    elif run is not None:
        console.print(render.jobs_table(runs[0]))
        render.print_reasons(console, runs[0])
    elif not runs:
        console.print("no warmup runs recorded yet")
    else:
        console.print(render.runs_table(runs))
