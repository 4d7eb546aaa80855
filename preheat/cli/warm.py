"""`preheat warm`: enqueue a warmup on every live worker (or the ones named), optionally wait."""

from __future__ import annotations

import getpass
import json
import socket
import time
import uuid
from typing import TYPE_CHECKING

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from preheat.cli import render
from preheat.cli.lazy import session_scope
from preheat.core.errors import ConfigError
from preheat.core.states import RunStatus

if TYPE_CHECKING:
    from preheat.history.models import WarmupRun
from preheat.cli.lazy import get_settings

console = render.console()
# 2 bad input, 3 no live worker and 5 services unreachable come from preheat.core.errors / cli.
EXIT_FAILED, EXIT_TIMEOUT, EXIT_DEGRADED = 1, 4, 6


def _requester() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except (KeyError, OSError):
        return "cli"


def _load(run_id: uuid.UUID) -> WarmupRun:
    from preheat.history import service

    with session_scope() as session:
        return service.get_run(session, run_id)


def _reap() -> None:
    """Settle jobs of dead workers now, so a wait never outlasts the reaper's bound. A worker
    whose heartbeat row is stale but whose pulse through the broker is fresh is alive (its
    database was away): its jobs wait for its outbox, never called lost."""
    from preheat.fleet import registry
    from preheat.fleet.liveness import pulses_for

    settings = get_settings()
    with session_scope() as session:
        registry.reap(
            session,
            dead_after_s=settings.worker_dead_after_s,
            time_limit_s=settings.task_time_limit_s,
            pulses=pulses_for(settings),
            lost_message_after_s=settings.lost_message_after_s,
        )


def wait_for_run(run_id: uuid.UUID, timeout_s: float, show_progress: bool, poll_s: float = 0.25) -> WarmupRun:
    """Poll history until every job of the run is final, or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    run = _load(run_id)
    next_reap = time.monotonic() + 5
    with Progress(
        TextColumn("warming"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not show_progress,
        transient=True,
    ) as progress:
        bar = progress.add_task("jobs", total=len(run.jobs))
        while time.monotonic() < deadline:
            run = _load(run_id)
            progress.update(bar, completed=sum(1 for job in run.jobs if job.status.is_final))
            # The run's status as well: a reaper's or an outbox replay's write settles it.
            if all(job.status.is_final for job in run.jobs) and run.status.is_final:
                break
            if time.monotonic() > next_reap:
                _reap()
                next_reap = time.monotonic() + 5
            time.sleep(poll_s)
    return run


def warm(
    template: list[str] = typer.Option(None, "--template", "-t", help="Template to warm (repeat; default: all)."),
    worker: list[str] = typer.Option(None, "--worker", "-w", help="Worker nodename (repeat; default: every live one)."),
    endpoint: list[str] = typer.Option(
        None, "--endpoint", "-e", help="Catalog endpoint to warm instead of workers (repeat)."
    ),
    adapter: list[str] = typer.Option(
        None, "--adapter", "-a", help="LoRA adapter to warm: its templates, under it (repeat)."
    ),
    if_cold: bool = typer.Option(False, "--if-cold", help="Skip templates a worker already holds warm."),
    wait: bool = typer.Option(False, "--wait", help="Wait for every job and print what was measured."),
    timeout: float = typer.Option(600.0, "--timeout", min=1.0, help="Seconds --wait waits."),
    requested_by: str = typer.Option(None, "--requested-by", help="Recorded in history (default: user@host)."),
    as_json: bool = typer.Option(False, "--json", help="Print the run as JSON."),
) -> None:
    """Warm models and system prompts on the fleet, and record the run in history.

    With --wait, exits 0 when every job is warm or skipped, 1 when one failed or was lost,
    6 when one is degraded (warm but not verified), 4 when the wait timed out."""
    from preheat.fleet.dispatch import dispatch_endpoint_warmup, dispatch_warmup

    if endpoint and worker:
        raise ConfigError("give --worker or --endpoint, not both: a run warms workers or endpoints")
    if adapter:
        template = adapter_templates(adapter, template)
    if endpoint:
        dispatched = dispatch_endpoint_warmup(
            endpoint, templates=template or None, requested_by=_requester() if requested_by is None else requested_by
        )
    else:
        dispatched = dispatch_warmup(
            templates=template or None,
            workers=worker or None,
            requested_by=_requester() if requested_by is None else requested_by,
            only_if_cold=if_cold,
        )
    what = f"{len(dispatched.templates)} template(s)"
    follow(dispatched, what, endpoints=bool(endpoint), wait=wait, timeout=timeout, as_json=as_json)


def adapter_templates(adapters: list[str], templates: list[str] | None) -> list[str]:
    """The templates pre-filled under `adapters` (of those named with --template, if any):
    warming them loads each adapter on every worker of its base, pins it, pre-fills, probes."""
    from preheat.core.catalog import load_catalog
    from preheat.core.settings import get_settings

    catalog = load_catalog(get_settings().catalog)
    chosen = []
    for adapter in adapters:
        names = [name for name in catalog.templates_under(adapter) if not templates or name in templates]
        if not names:
            raise ConfigError(f"no template named with --template is under adapter {adapter!r}")
        chosen += names
    return chosen


def follow(dispatched, what: str, *, endpoints: bool, wait: bool, timeout: float, as_json: bool) -> None:
    """After a dispatch: what was queued (`what`, on which targets), then the run as JSON, or
    (with `wait`) its jobs as they finish, and the exit code its outcome says (see `warm`)."""
    if not as_json:
        kind = "endpoint(s)" if endpoints else "worker(s)"
        console.print(
            f"run [bold]{dispatched.run_id.hex[:8]}[/] queued: {what} "
            f"on {len(dispatched.workers)} {kind}: {', '.join(dispatched.workers)}"
        )
    if not wait:
        if as_json:
            print(json.dumps(render.run_json(_load(dispatched.run_id)), indent=2))
        return
    run = wait_for_run(dispatched.run_id, timeout, show_progress=not as_json)
    if as_json:
        print(json.dumps(render.run_json(run), indent=2))
    else:
        console.print(render.jobs_table(run))
        render.print_reasons(console, run)
    if not all(job.status.is_final for job in run.jobs):
        console.print(f"[yellow]timed out after {timeout:.0f} s with jobs still pending[/]")
        raise typer.Exit(EXIT_TIMEOUT)
    if run.status == RunStatus.failed:
        raise typer.Exit(EXIT_FAILED)
    if run.status == RunStatus.degraded:
        raise typer.Exit(EXIT_DEGRADED)
