"""`preheat bench history`: what `preheat history`, `preheat workers` and the history's own
writes cost on a large record, with and without the indexes of migration 0008, side by side
in one run; then what `preheat db prune` takes to bring it back to its retention.

It runs on a scratch database of its own, created on the configured PostgreSQL server (the
production history; SQLite is the embedded default's, not a fleet's) and dropped at the
end: the operator's history is never touched. The record is made by the server itself
(generate_series): runs of four jobs spread over `days`, 1 % failed and 3 % degraded, a few
still running, and 200 worker records of which 20 are live. Every query is the service
function the command calls, timed as the median of `repeats`; every statement it sent is
shown with the plan PostgreSQL chose for it (EXPLAIN), so a sequential scan is seen, not
guessed. Writes are rolled back after each timing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from preheat.cli.bench.common import database_url, host, write_report
from preheat.core.errors import ConfigError

JOBS_PER_RUN = 4
WORKERS, LIVE_WORKERS = 200, 20
# Migration 0008's indexes: the schema at head without them is what "without" measures (the
# schema of 0007 itself lacks the columns later migrations added, which the writes need).
HISTORY_INDEXES = {
    "ix_warmup_runs_status_created_at": "warmup_runs (status, created_at)",
    "ix_warmup_runs_trigger_created_at": "warmup_runs (trigger, created_at)",
    "ix_warmup_jobs_celery_task_id": "warmup_jobs (celery_task_id)",
}


@dataclass
class Timed:
    name: str
    ms: dict[str, float] = field(default_factory=dict)  # schema -> median ms
    plans: dict[str, list[str]] = field(default_factory=dict)  # schema -> one line per statement


def scratch_url(url: str) -> tuple[str, str]:
    """(the admin URL of the server, the URL of a new scratch database on it)."""
    parsed = make_url(url)
    if not parsed.drivername.startswith("postgresql"):
        raise ConfigError(
            "bench history measures PostgreSQL, the production history: set PREHEAT_DATABASE_URL "
            "(or --database-url) to a postgresql:// server"
        )
    name = f"preheat_bench_history_{uuid.uuid4().hex[:8]}"
    return (
        parsed.set(database="postgres").render_as_string(hide_password=False),
        parsed.set(database=name).render_as_string(hide_password=False),
    )


@contextlib.contextmanager
def scratch_database(url: str) -> Iterator[str]:
    from preheat.history.db import open_database

    admin_url, scratch = scratch_url(url)
    name = make_url(scratch).database
    admin = open_database(admin_url).execution_options(isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        with database_url(scratch):
            yield scratch
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


FILL = [
    # Runs: newest first in g; the 5 newest still running, 1 % failed, 3 % degraded.
    """
    INSERT INTO warmup_runs (id, trigger, trigger_detail, requested_by, status, created_at, finished_at)
    SELECT md5('run' || g)::uuid,
           CASE WHEN g % 50 = 0 THEN 'peak' WHEN g % 7 = 0 THEN 'pod_event' ELSE 'schedule' END,
           '{}'::json, 'bench',
           CASE WHEN g <= 5 THEN 'running' WHEN g % 100 = 0 THEN 'failed'
                WHEN g % 33 = 0 THEN 'degraded' ELSE 'succeeded' END,
           now() - (g::float / :runs) * (:days || ' days')::interval,
           CASE WHEN g <= 5 THEN NULL
                ELSE now() - (g::float / :runs) * (:days || ' days')::interval + interval '20 seconds' END
    FROM generate_series(1, :runs) AS g
    """,
    """
    INSERT INTO warmup_jobs (id, run_id, target_kind, target, model, template, celery_task_id, status,
                             started_at, finished_at, ttft_warm_ms, ttft_bare_ms, cached_tokens)
    SELECT md5('job' || g || '-' || t)::uuid, md5('run' || g)::uuid, 'worker',
           'gpu' || (g % :workers) || '@node', 'tiny', 't' || t, md5('task' || g),
           CASE WHEN g <= 5 THEN 'running' WHEN g % 100 = 0 AND t = 0 THEN 'failed'
                WHEN g % 33 = 0 AND t = 0 THEN 'degraded' ELSE 'warm' END,
           r.created_at, r.finished_at, 12.5, 11.0, 480
    FROM generate_series(1, :runs) AS g
    CROSS JOIN generate_series(0, :per_run - 1) AS t
    JOIN warmup_runs AS r ON r.id = md5('run' || g)::uuid
    """,
    """
    INSERT INTO workers (id, nodename, hostname, pid, started_at, heartbeat_at, ready, state)
    SELECT md5('worker' || w)::uuid, 'gpu' || w || '@node', 'node', w,
           now() - interval '1 day',
           CASE WHEN w < :live THEN now() ELSE now() - (w || ' days')::interval END,
           w < :live, '{}'::json
    FROM generate_series(0, :workers - 1) AS w
    """,
]


def fill(url: str, jobs: int, days: int) -> int:
    """The record, made by the server; on an engine of its own, without the statement bound
    every preheat process has (a bulk fill is not a command's query)."""
    from preheat.history.db import open_database

    runs = -(-jobs // JOBS_PER_RUN)
    params = {"runs": runs, "days": str(days), "workers": WORKERS, "live": LIVE_WORKERS, "per_run": JOBS_PER_RUN}
    engine = open_database(url)
    try:
        with engine.begin() as connection:
            for statement in FILL:
                connection.execute(text(statement), params)
        with engine.connect() as connection:
            connection.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM ANALYZE"))
    finally:
        engine.dispose()
    return runs


def queries() -> list[tuple[str, Callable[[Session], object]]]:
    from preheat.cli.history import parse_since
    from preheat.core.states import JobStatus, RunStatus, TriggerKind
    from preheat.fleet import registry
    from preheat.history import service
    from preheat.history.db import utcnow

    # Run 1000 as the fill made it: its id, its task and its worker.
    a_run, a_task = uuid.UUID(hashlib.md5(b"run1000").hexdigest()), hashlib.md5(b"task1000").hexdigest()
    its_worker = f"gpu{1000 % WORKERS}@node"
    return [
        ("preheat history", lambda s: service.list_runs(s)),
        ("preheat history --status running", lambda s: service.list_runs(s, status=RunStatus.running)),
        ("preheat history --status failed", lambda s: service.list_runs(s, status=RunStatus.failed)),
        ("preheat history --trigger peak", lambda s: service.list_runs(s, trigger=TriggerKind.peak)),
        ("preheat history --since 6h", lambda s: service.list_runs(s, since=parse_since("6h"))),
        ("preheat history RUN (id prefix)", lambda s: service.find_run(s, a_run.hex[:8])),
        ("preheat workers", lambda s: registry.workers(s)),
        (
            "a job's finish (worker)",
            lambda s: service.finish_job(
                s, a_run, target=its_worker, template="t1", status=JobStatus.warm, measured={"ttft_warm_ms": 12.0}
            ),
        ),
        ("a task's failure (worker)", lambda s: service.fail_task_jobs(s, a_task, "bench", utcnow())),
        (
            "the reaper's pass (heartbeat)",
            lambda s: registry.reap(s, dead_after_s=45, time_limit_s=3600, now=utcnow()),
        ),
    ]


def measure(schema: str, timed: dict[str, Timed], repeats: int) -> None:
    from preheat.history.db import database

    engine = database()
    for name, query in queries():
        row = timed.setdefault(name, Timed(name))
        sent: list[tuple[str, object]] = []

        def capture(conn, cursor, statement, parameters, context, executemany, sent=sent):
            if not executemany and statement.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE")):
                sent.append((statement, parameters))

        took = []
        for attempt in range(repeats + 1):  # the first is untimed: caches and plans
            if attempt == 1:
                event.listen(engine, "before_cursor_execute", capture)
            with Session(engine) as session:
                started = time.perf_counter()
                query(session)
                session.flush()
                took.append((time.perf_counter() - started) * 1000)
                session.rollback()
            if attempt == 1:
                event.remove(engine, "before_cursor_execute", capture)
        row.ms[schema] = statistics.median(took[1:])
        row.plans[schema] = [_plan(engine, statement, parameters) for statement, parameters in sent]


def _plan(engine, statement: str, parameters) -> str:
    """The access paths PostgreSQL chose for one statement: each scan with its index."""
    with engine.connect() as connection:
        try:
            [[plan]] = connection.exec_driver_sql("EXPLAIN (FORMAT JSON) " + statement, parameters).all()
        except Exception as exc:
            raise RuntimeError(f"EXPLAIN of {statement!r} with {parameters!r}: {exc}") from exc
        connection.rollback()
    scans: list[str] = []

    def walk(node: dict) -> None:
        kind = node["Node Type"]
        if "Scan" in kind:
            where = node.get("Index Name") or node.get("Relation Name", "")
            scans.append(f"{kind} {where}".strip())
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    return ", ".join(scans) or plan[0]["Plan"]["Node Type"]


def prune_timed(retention_days: int) -> dict:
    from preheat.history import prune

    started = time.perf_counter()
    counted = prune.prune(dt.timedelta(days=retention_days), dry_run=True)
    dry_s = time.perf_counter() - started
    started = time.perf_counter()
    pruned = prune.prune(dt.timedelta(days=retention_days))
    prune_s = time.perf_counter() - started
    return {
        "retention_days": retention_days,
        "dry_run_s": dry_s,
        "prune_s": prune_s,
        "counted": counted.counts,
        "deleted": pruned.counts,
        "rows_per_s": pruned.total / prune_s if prune_s else 0.0,
    }


def exporter_timed(repeats: int) -> dict:
    """What `preheat exporter` costs on this record: its first scrape counts every finished job
    (one grouped statement), each later one reads what finished since."""
    from prometheus_client import CollectorRegistry, generate_latest

    from preheat.core.catalog import load_catalog
    from preheat.core.settings import get_settings
    from preheat.fleet.exporter import FleetCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(load_catalog(get_settings().catalog), get_settings()))
    started = time.perf_counter()
    generate_latest(registry)
    first_ms = (time.perf_counter() - started) * 1000
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        generate_latest(registry)
        times.append((time.perf_counter() - started) * 1000)
    return {"first_scrape_ms": first_ms, "scrape_ms": statistics.median(times)}


def _history_indexes(url: str, statement: str) -> None:
    """Drop or create migration 0008's indexes on the scratch database."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as connection:
        for name, columns in HISTORY_INDEXES.items():
            connection.execute(text(statement.format(name=name, columns=columns)))
        connection.execute(text("ANALYZE"))
    engine.dispose()


def main(jobs: int, days: int, retention_days: int, repeats: int, server_url: str | None, json_path: Path) -> None:
    """The command (its options are declared in preheat.cli.bench): measure, print, write JSON."""
    from rich.table import Table

    from preheat.cli import render
    from preheat.core.settings import get_settings
    from preheat.history import migrate

    console = render.console()
    settings = get_settings()
    timed: dict[str, Timed] = {}
    with scratch_database(server_url or settings.database) as scratch:
        migrate.upgrade(scratch, "head")
        _history_indexes(scratch, "DROP INDEX {name}")
        started = time.perf_counter()
        runs = fill(scratch, jobs, days)
        console.print(f"{runs:,} runs, {runs * JOBS_PER_RUN:,} jobs made in {time.perf_counter() - started:.1f} s")
        measure("without", timed, repeats)
        _history_indexes(scratch, "CREATE INDEX {name} ON {columns}")
        measure("with", timed, repeats)
        exporter = exporter_timed(repeats)
        pruned = prune_timed(retention_days)
    report = {
        "benchmark": "history",
        "host": host(),
        "runs": runs,
        "jobs": runs * JOBS_PER_RUN,
        "days": days,
        "repeats": repeats,
        "queries": [vars(row) for row in timed.values()],
        "exporter": exporter,
        "prune": pruned,
    }
    table = Table(
        title=f"history at {runs * JOBS_PER_RUN:,} jobs over {days} days: median ms, without and with 0008's indexes",
        title_justify="left",
    )
    for header in ("query", "ms (without)", "ms (with)", "plan with them"):
        table.add_column(header, justify="right" if header.startswith("ms") else "left")
    for row in timed.values():
        scans = dict.fromkeys(scan for plan in row.plans["with"] for scan in plan.split(", "))
        table.add_row(row.name, f"{row.ms['without']:.2f}", f"{row.ms['with']:.2f}", ", ".join(scans))
    console.print(table)
    console.print(
        f"preheat exporter: first scrape (every finished job counted once) {exporter['first_scrape_ms']:,.1f} ms, "
        f"then {exporter['scrape_ms']:,.1f} ms a scrape (median of {repeats})"
    )
    deleted = pruned["deleted"]
    console.print(
        f"prune to {retention_days} days: dry run {pruned['dry_run_s']:.1f} s, prune {pruned['prune_s']:.1f} s "
        f"({deleted['warmup_runs']:,} runs, {deleted['warmup_jobs']:,} jobs, {pruned['rows_per_s']:,.0f} rows/s)"
    )
    write_report(report, json_path or settings.home / "bench" / "runs.json", console)
