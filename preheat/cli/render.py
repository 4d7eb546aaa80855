"""How runs and jobs look at the terminal and in --json."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from preheat.core.states import WHOLE_MODEL, JobStatus

if TYPE_CHECKING:
    from preheat.history.models import WarmupJob, WarmupRun, WorkerRecord
    from preheat.history.prune import PruneResult


def short_id(run: WarmupRun) -> str:
    return run.id.hex[:8]


def ms_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def saved_pct(job: WarmupJob) -> float | None:
    """Share of the cold TTFT that the cached prefix saved."""
    if not job.ttft_cold_ms or job.ttft_warm_ms is None:
        return None
    return 100.0 * (1 - job.ttft_warm_ms / job.ttft_cold_ms)


def when(value: dt.datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def _kib(value: int | None) -> str:
    return "-" if value is None else f"{value / 1024:,.0f}"


JOB_COLUMNS = (
    "target",
    "template",
    "status",
    "load ms",
    "connect ms",
    "prefill ms",
    "restore ms",
    "TTFT cold",
    "TTFT warm",
    "TTFT bare",
    "TTFT steady",
    "saved",
    "tokens",
    "KiB",
)


SLEEP_COLUMNS = ("target", "model", "status", "level", "sleep ms", "wake ms", "load ms", "MiB freed")


def jobs_table(run: WarmupRun) -> Table | Group:
    """A run's jobs: a sleep's or a wake's whole-model rows (their own figures), then the
    templates' warmups (a wake warms its model's templates)."""
    whole = [job for job in run.jobs if job.template == WHOLE_MODEL]
    warmups = [job for job in run.jobs if job.template != WHOLE_MODEL]
    if not whole:
        return warmups_table(run, warmups)
    if not warmups:
        return sleep_table(run, whole)
    return Group(sleep_table(run, whole), warmups_table(run, warmups))


def sleep_table(run: WarmupRun, jobs: list[WarmupJob]) -> Table:
    table = Table(
        title=f"run {short_id(run)} · {run.action} · {run.trigger} · {run.status}",
        title_justify="left",
        caption="sleep ms: running requests finished, KV freed, weights off the device; "
        "MiB freed: KV and weights, as counted; wake ms: the weights back (load ms: level 2's reload)",
        caption_justify="left",
    )
    for header in SLEEP_COLUMNS:
        table.add_column(header, justify="left" if header in SLEEP_COLUMNS[:3] else "right", no_wrap=True)
    for job in jobs:
        table.add_row(
            job.target,
            job.model,
            str(job.status),
            "-" if job.sleep_level is None else str(job.sleep_level),
            ms_cell(job.sleep_ms),
            ms_cell(job.wake_ms),
            ms_cell(job.load_ms),
            "-" if job.bytes_freed is None else f"{job.bytes_freed / 2**20:,.1f}",
        )
    return table


def warmups_table(run: WarmupRun, jobs: list[WarmupJob]) -> Table:
    models = sorted({f"{job.model} on {job.device}" if job.device else job.model for job in jobs})
    table = Table(
        title=f"run {short_id(run)} · {run.action} · {run.trigger} · {run.status}",
        title_justify="left",
        caption=f"{'; '.join(models)} · TTFT in ms, median of the probe runs; "
        "bare = the probe with no system prompt; steady = the worker's served requests; "
        "restore = the prefix read from the prefix store instead of pre-filled",
        caption_justify="left",
    )
    for header in JOB_COLUMNS:
        table.add_column(header, justify="left" if header in JOB_COLUMNS[:3] else "right", no_wrap=True)
    for job in jobs:
        saved = saved_pct(job)
        table.add_row(
            job.target,
            job.template,
            str(job.status),
            ms_cell(job.load_ms),
            ms_cell(job.connect_ms),
            ms_cell(job.prefill_ms),
            ms_cell(job.restore_ms),
            ms_cell(job.ttft_cold_ms),
            ms_cell(job.ttft_warm_ms),
            ms_cell(job.ttft_bare_ms),
            ms_cell(job.ttft_steady_ms),
            "-" if saved is None else f"{saved:.0f}%",
            "-" if job.cached_tokens is None else str(job.cached_tokens),
            _kib(job.cache_bytes),
        )
    return table


def print_reasons(out: Console, run: WarmupRun) -> None:
    """Why each job that is not plainly warm is what it is: red for failures, yellow else."""
    for job in run.jobs:
        if job.error:
            style = "red" if job.status in (JobStatus.failed, JobStatus.lost) else "yellow"
            line = escape(f"{job.target} · {job.template} · {job.status}: {job.error}")
            out.print(f"[{style}]{line}[/]", highlight=False)
        for earlier in job.superseded or []:  # what it was before its final word arrived
            out.print(
                f"[dim]{job.target} · {job.template} · was {earlier['status']} at {earlier.get('at') or '?'}"
                f"{escape(': ' + earlier['error']) if earlier.get('error') else ''}[/]",
                highlight=False,
            )
    for change in run.status_changes or []:
        out.print(f"[dim]run status {change['from']} → {change['to']} at {change['at']}[/]", highlight=False)


def runs_table(runs: list[WarmupRun]) -> Table:
    table = Table(title="warmup runs, newest first", title_justify="left")
    for header in (
        "run",
        "created (UTC)",
        "action",
        "trigger",
        "detail",
        "requested by",
        "status",
        "jobs",
        "finished (UTC)",
    ):
        table.add_column(header)
    for run in runs:
        done = sum(1 for job in run.jobs if job.status.is_final)
        # Nested parts (a peak schedule's peak) are in --json; the table keeps to one line each.
        detail = (
            ", ".join(f"{k}={v}" for k, v in (run.trigger_detail or {}).items() if not isinstance(v, dict | list))
            or "-"
        )
        table.add_row(
            short_id(run),
            when(run.created_at),
            str(run.action),
            str(run.trigger),
            escape(detail),
            escape(run.requested_by),
            str(run.status),
            f"{done}/{len(run.jobs)}",
            when(run.finished_at),
        )
    return table


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def run_json(run: WarmupRun) -> dict:
    return {
        "id": str(run.id),
        "action": str(run.action),
        "trigger": str(run.trigger),
        "trigger_detail": run.trigger_detail,
        "trigger_key": run.trigger_key,
        "requested_by": run.requested_by,
        "status": str(run.status),
        "created_at": _iso(run.created_at),
        "finished_at": _iso(run.finished_at),
        "status_changes": run.status_changes or [],
        "jobs": [
            {
                "target": job.target,
                "target_kind": str(job.target_kind),
                "model": job.model,
                "template": job.template,
                "status": str(job.status),
                "celery_task_id": job.celery_task_id,
                "device": job.device,
                "started_at": _iso(job.started_at),
                "finished_at": _iso(job.finished_at),
                "load_ms": job.load_ms,
                "prefill_ms": job.prefill_ms,
                "prefix_source": job.prefix_source,
                "restore_ms": job.restore_ms,
                "ttft_cold_ms": job.ttft_cold_ms,
                "ttft_warm_ms": job.ttft_warm_ms,
                "ttft_bare_ms": job.ttft_bare_ms,
                "ttft_steady_ms": job.ttft_steady_ms,
                "connect_ms": job.connect_ms,
                "saved_pct": saved_pct(job),
                "cached_tokens": job.cached_tokens,
                "cache_bytes": job.cache_bytes,
                "sleep_level": job.sleep_level,
                "sleep_ms": job.sleep_ms,
                "bytes_freed": job.bytes_freed,
                "wake_ms": job.wake_ms,
                "error": job.error,
                "superseded": job.superseded or [],
            }
            for job in run.jobs
        ],
    }


def prune_table(result: PruneResult) -> Table:
    verb = "would delete" if result.dry_run else "deleted"
    table = Table(title=f"history older than {when(result.cutoff)} UTC: rows {verb}", title_justify="left")
    table.add_column("table")
    table.add_column("rows", justify="right")
    for name, count in result.counts.items():
        table.add_row(name, f"{count:,}")
    return table


def prune_json(result: PruneResult) -> dict:
    return {"cutoff": _iso(result.cutoff), "dry_run": result.dry_run, "counts": result.counts}


def console() -> Console:
    """Rich console; when output is piped, wide enough that tables are not squeezed to 80 columns."""
    plain = Console()
    return plain if plain.is_terminal else Console(width=160)


def worker_state(record: WorkerRecord, live: bool) -> str:
    if not live:
        return "stopped" if record.stopped_at else "dead"
    if asleep := (record.state or {}).get("asleep"):
        return f"asleep ({', '.join(asleep)})"
    return "ready" if record.ready else "starting"


def workers_table(records: list[tuple[WorkerRecord, bool]]) -> Table:
    """`preheat workers`: what each worker's latest heartbeat said; with a catalog spread
    across the fleet (preheat.fleet.placement), which templates each pins."""
    spread = any(((r.state or {}).get("templates") or {}).get("planned") is not None for r, _ in records)
    table = Table(
        title="preheat workers",
        title_justify="left",
        caption="cache = the KV prefix cache: entries and bytes against the worker's budget; "
        "outbox = history writes waiting for the database",
        caption_justify="left",
    )
    for header in (
        "worker",
        "state",
        "last heartbeat (UTC)",
        "models",
        "cache entries",
        "cache MiB",
        "hit rate",
        *(["templates pinned"] if spread else []),
        "outbox",
        "not ready because",
    ):
        table.add_column(header, justify="right" if header.startswith(("cache", "hit", "outbox")) else "left")
    for record, live in records:
        state, cache = record.state or {}, (record.state or {}).get("cache", {})
        models = ", ".join(_model_cell(name, spec) for name, spec in state.get("models", {}).items()) or "-"
        lookups = cache.get("hits", 0) + cache.get("misses", 0)
        table.add_row(
            record.nodename,
            worker_state(record, live),
            when(record.heartbeat_at),
            models,
            f"{cache.get('entries', 0)}/{cache.get('max_entries', '-')}",
            f"{cache.get('bytes', 0) / 2**20:,.1f}/{cache.get('max_bytes', 0) / 2**20:,.0f}",
            f"{100 * cache.get('hits', 0) / lookups:.0f}%" if lookups else "-",
            *([templates_cell(state.get("templates"))] if spread else []),
            outbox_cell(state.get("outbox")),
            escape("; ".join(state.get("reasons", [])) or "-"),
        )
    return table


def templates_cell(templates: dict | None) -> str:
    """The templates pinned and warm, and this worker's share of the fleet's plan when the
    catalog is spread (preheat.fleet.placement)."""
    if not templates:
        return "-"
    held, planned = templates.get("held") or [], templates.get("planned")
    shown = ", ".join(held) or "none"
    if planned is not None and set(planned) != set(held):
        shown += f" (plan: {', '.join(planned) or 'none'})"
    return shown


def _model_cell(name: str, spec: dict) -> str:
    """A resident model: its device and dtype, and what read its weights (workers/weights.py)."""
    loader = spec.get("weight_loader")  # absent from heartbeats of workers before the streamer
    return f"{name} ({spec['device']}{f', {loader}' if loader else ''})"


def outbox_cell(counts: dict | None) -> str:
    """History writes waiting for the database (and set aside for good, if any)."""
    if not counts:
        return "-"
    return f"{counts['pending']}" + (f" ({counts['dead']} set aside)" if counts.get("dead") else "")


def worker_json(record: WorkerRecord, live: bool) -> dict:
    return {
        "nodename": record.nodename,
        "hostname": record.hostname,
        "pid": record.pid,
        "state": worker_state(record, live),
        "ready": record.ready,
        "started_at": _iso(record.started_at),
        "heartbeat_at": _iso(record.heartbeat_at),
        "stopped_at": _iso(record.stopped_at),
        **(record.state or {}),
    }
