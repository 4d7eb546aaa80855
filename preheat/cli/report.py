"""`preheat report --since 1h`: one self-contained HTML file with plots of the range."""

from __future__ import annotations

from pathlib import Path

import typer

from preheat.cli.lazy import get_settings, session_scope, utcnow


def report(
    since: str = typer.Option("24h", "--since", help="How far back: 30m, 6h, 7d."),
    out: Path = typer.Option(None, "--out", "-o", help="The HTML file to write (default: HOME/report.html)."),
) -> None:
    """Write one HTML file (no network needed to open it): TTFT cold / warm / bare per template
    over time, verdicts per worker, schedule fires against learned peaks and traffic, KV bytes."""
    from preheat.cli.history import parse_since
    from preheat.cli.render import console
    from preheat.core.errors import ConfigError
    from preheat.fleet import report as service

    start = parse_since(since)
    until = utcnow()
    if start >= until:
        raise ConfigError(f"--since {since!r} is not in the past")
    out = out or get_settings().home / "report.html"
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name")
    with session_scope() as session:
        data = service.gather(session, start, until)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(service.render(data))
    partial.replace(out)  # whole or not at all
    console().print(f"wrote {out}: {data.jobs} job(s) from the last {since}")
