"""`preheat workers`: the live workers, what each holds, and whether it takes traffic."""

from __future__ import annotations

import json

import typer

from preheat.cli import render
from preheat.cli.lazy import get_settings, session_scope, utcnow

console = render.console()


def workers(
    show_all: bool = typer.Option(False, "--all", help="Also stopped and dead workers (silent past the bound)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List workers from their heartbeats: state, resident models, KV cache use, readiness."""
    from preheat.fleet import registry

    dead_after, now = get_settings().worker_dead_after_s, utcnow()
    with session_scope() as session:
        rows = [(record, registry.is_live(record, dead_after, now)) for record in registry.workers(session)]
    rows = [(record, live) for record, live in rows if live or show_all]
    if as_json:
        print(json.dumps([render.worker_json(record, live) for record, live in rows], indent=2))
    elif not rows:
        console.print("no live preheat worker" + ("" if show_all else " (--all shows stopped and dead ones)"))
    else:
        console.print(render.workers_table(rows))
