"""`preheat warm`: enqueue a warmup on every live worker (or the ones named), optionally wait."""

from __future__ import annotations

import getpass
import json
import socket
import time
import uuid

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from preheat import history
from preheat.cli import render
from preheat.db import session_scope
from preheat.models import RunStatus, WarmupRun

console = render.console()
EXIT_FAILED, EXIT_TIMEOUT = 1, 4


def _requester() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except (KeyError, OSError):
        return "cli"


def _load(run_id: uuid.UUID) -> WarmupRun:
    with session_scope() as session:
        return history.get_run(session, run_id)


def wait_for_run(run_id: uuid.UUID, timeout_s: float, show_progress: bool) -> WarmupRun:
    """Poll history until every job of the run is final, or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    run = _load(run_id)
    with Progress(TextColumn("warming"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not show_progress, transient=True) as progress:
        bar = progress.add_task("jobs", total=len(run.jobs))
        while time.monotonic() < deadline:
            run = _load(run_id)
            progress.update(bar, completed=sum(1 for job in run.jobs if job.status.is_final))
            if all(job.status.is_final for job in run.jobs):
                break
            time.sleep(0.25)
    return run


def warm(
    template: list[str] = typer.Option(None, "--template", "-t", help="Template to warm (repeat; default: all)."),
    worker: list[str] = typer.Option(None, "--worker", "-w", help="Worker nodename (repeat; default: every live one)."),
    wait: bool = typer.Option(False, "--wait", help="Wait for every job and print what was measured."),
    timeout: float = typer.Option(600.0, "--timeout", min=1.0, help="Seconds --wait waits."),
    requested_by: str = typer.Option(None, "--requested-by", help="Recorded in history (default: user@host)."),
    as_json: bool = typer.Option(False, "--json", help="Print the run as JSON."),
) -> None:
    """Warm models and system prompts on the fleet, and record the run in history."""
    from tasks.fleet import dispatch_warmup

    dispatched = dispatch_warmup(templates=template or None, workers=worker or None,
                                 requested_by=requested_by or _requester())
    if not as_json:
        console.print(f"run [bold]{dispatched.run_id.hex[:8]}[/] queued: {len(dispatched.templates)} template(s) "
                      f"on {len(dispatched.workers)} worker(s): {', '.join(dispatched.workers)}")
    if not wait:
        if as_json:
            print(json.dumps(render.run_json(_load(dispatched.run_id)), indent=2))
        return
    run = wait_for_run(dispatched.run_id, timeout, show_progress=not as_json)
    if as_json:
        print(json.dumps(render.run_json(run), indent=2))
    else:
        console.print(render.jobs_table(run))
        for line in render.errors_of(run):
            console.print(f"[red]{line}[/]", highlight=False)
    if not all(job.status.is_final for job in run.jobs):
        console.print(f"[yellow]timed out after {timeout:.0f} s with jobs still pending[/]")
        raise typer.Exit(EXIT_TIMEOUT)
    if run.status == RunStatus.failed:
        raise typer.Exit(EXIT_FAILED)
