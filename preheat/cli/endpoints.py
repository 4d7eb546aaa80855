"""`preheat endpoints`: the catalog's model servers and their keep-alive record."""

from __future__ import annotations

import json

import typer
from rich.markup import escape
from rich.table import Table

from preheat.cli import render
from preheat.cli.lazy import get_settings, load_catalog, session_scope

console = render.console()


def endpoints(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List endpoints: kind, pool size, templates primed, keep-alive pings sent."""
    catalog = load_catalog(get_settings().catalog)
    from preheat.history import service

    with session_scope() as session:
        counters = {row.endpoint: row for row in service.keepalives(session)}
    rows = []
    for name, spec in catalog.endpoints.items():
        kept = counters.get(name)
        rows.append(
            {
                "endpoint": name,
                "kind": spec.kind,
                "base_url": spec.base_url,
                "templates": spec.templates,
                "min_connections": spec.min_connections,
                "max_connections": spec.max_connections,
                "http2": spec.http2,
                "keepalive_interval_s": spec.keepalive_interval_s,
                "active_hours": spec.active_hours,
                "timezone": spec.timezone,
                "pings_sent": kept.pings_sent if kept else 0,
                "pings_failed": kept.pings_failed if kept else 0,
                "skipped_inactive": kept.skipped_inactive if kept else 0,
                "last_ping_at": kept.last_ping_at.isoformat() if kept and kept.last_ping_at else None,
                "last_ttft_ms": kept.last_ttft_ms if kept else None,
                "last_error": kept.last_error if kept else None,
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print(escape(f"catalog {get_settings().catalog} has no [endpoints.*]"))
        return
    table = Table(title="endpoints", title_justify="left")
    for header in (
        "endpoint",
        "kind",
        "base URL",
        "templates",
        "connections",
        "keep-alive",
        "pings sent",
        "failed",
        "skipped",
        "last TTFT ms",
        "last error",
    ):
        table.add_column(header)
    for row in rows:
        interval = f"every {row['keepalive_interval_s']:g} s" if row["keepalive_interval_s"] else "off"
        hours = f" {row['active_hours']} {row['timezone']}" if row["active_hours"] else ""
        table.add_row(
            row["endpoint"],
            row["kind"],
            row["base_url"],
            ", ".join(row["templates"]) or "-",
            f"{row['min_connections']}-{row['max_connections']}" + (" h2" if row["http2"] else ""),
            interval + hours,
            str(row["pings_sent"]),
            str(row["pings_failed"]),
            str(row["skipped_inactive"]),
            "-" if row["last_ttft_ms"] is None else f"{row['last_ttft_ms']:,.1f}",
            escape(row["last_error"] or "-"),
        )
    console.print(table)
