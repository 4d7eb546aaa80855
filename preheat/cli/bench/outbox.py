"""`preheat bench outbox`: what the history outbox costs a worker, side by side in one run, on
the configured database: a job's finish written straight to the database; the same write
while the database is away (the failed attempt, then the entry kept on disk); and the replay
once it is back (how fast a backlog drains).

The database is made "away" for this process only: its URL is pointed at a port nothing
listens on (or, for SQLite, at a folder that does not exist), which is what a restarting
server looks like to a client (connection refused). The writes go to throwaway runs that
are deleted at the end (runs of four jobs, like a warmup of four templates), with their
`applied_writes` rows.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import delete
from sqlalchemy.engine import make_url

from preheat.cli.bench.common import database_url, host, prepare, write_report
from preheat.cli.lazy import get_settings
from preheat.core import processes
from preheat.history import outbox, service
from preheat.history.db import session_scope, utcnow
from preheat.history.models import AppliedWrite, TriggerKind, WarmupRun

SOURCE = "bench-outbox"


@dataclass(frozen=True)
class Way:
    name: str
    writes: int
    p50_ms: float
    p99_ms: float
    total_s: float

    @property
    def per_s(self) -> float:
        return self.writes / self.total_s if self.total_s else 0.0


def unreachable_url(url: str) -> str:
    """The same database, at an address that refuses connections."""
    parsed = make_url(url)
    if parsed.drivername.startswith("sqlite"):
        return f"sqlite:///{Path('/nonexistent-preheat-bench') / 'preheat.db'}"
    return parsed.set(host="127.0.0.1", port=processes.free_port()).render_as_string(hide_password=False)


def database_away() -> contextlib.AbstractContextManager[None]:
    """Point this process's engine at an unreachable address, and back."""
    return database_url(unreachable_url(get_settings().database))


JOBS_PER_RUN = 4  # a run warming four templates on one worker: each finish re-derives its run's status


def _throwaway_runs(jobs: int) -> tuple[list[str], str]:
    target = f"{SOURCE}@{uuid.uuid4().hex[:8]}"
    with session_scope() as session:
        runs = []
        for _ in range(-(-jobs // JOBS_PER_RUN)):
            run = service.create_run(session, trigger=TriggerKind.manual, requested_by="preheat bench outbox")
            service.add_jobs(
                session,
                run,
                target=target,
                task_id=str(uuid.uuid4()),
                model_templates=[("bench", f"t{n}") for n in range(JOBS_PER_RUN)],
            )
            runs.append(str(run.id))
        return runs, target


def _finish(runs: list[str], target: str, n: int) -> dict:
    return {
        "run_id": runs[n // JOBS_PER_RUN],
        "target": target,
        "template": f"t{n % JOBS_PER_RUN}",
        "status": "warm",
        "measured": {"prefill_ms": 12.5, "ttft_warm_ms": 3.25, "cached_tokens": 48},
        "at": utcnow(),
    }


def _timed_writes(box: outbox.Outbox, payloads: list[dict], name: str) -> Way:
    took, started = [], time.perf_counter()
    for payload in payloads:
        one = time.perf_counter()
        box.write(service.JOB_FINISH, payload)
        took.append((time.perf_counter() - one) * 1000)
    return _way(name, took, time.perf_counter() - started)


def _way(name: str, took_ms: list[float], total_s: float) -> Way:
    took_ms = sorted(took_ms)
    p99 = took_ms[min(len(took_ms) - 1, int(len(took_ms) * 0.99))]
    return Way(name, len(took_ms), statistics.median(took_ms), p99, total_s)


def run(writes: int, folder: Path) -> tuple[list[Way], int]:
    """(the three ways, entries left in the outbox after the replay: 0 when none was lost)."""
    runs, target = _throwaway_runs(2 * writes)
    box = outbox.Outbox(outbox.path_for(folder, f"{SOURCE}-{uuid.uuid4().hex[:8]}"), SOURCE, [service.JOB_FINISH])
    try:
        direct = _timed_writes(box, [_finish(runs, target, n) for n in range(writes)], "written directly")
        with database_away():
            kept = _timed_writes(
                box, [_finish(runs, target, writes + n) for n in range(writes)], "database away: kept in the outbox"
            )
        started = time.perf_counter()
        replayed = box.replay(limit=writes)
        replay = Way("replayed once it is back", replayed, 0.0, 0.0, time.perf_counter() - started)
        left = box.counts().pending
    finally:
        box.close()
        box.path.unlink(missing_ok=True)
        for suffix in ("-wal", "-shm"):
            Path(f"{box.path}{suffix}").unlink(missing_ok=True)
        with session_scope() as session:
            session.execute(delete(AppliedWrite).where(AppliedWrite.source == SOURCE))
            for run_id in runs:  # the ORM's cascade takes the jobs along
                session.delete(session.get(WarmupRun, uuid.UUID(run_id)))
    return [direct, kept, replay], left


def main(writes: int, json_path: Path) -> None:
    """The command (its options are declared in preheat.cli.bench): measure, print, write JSON."""
    from rich.table import Table

    from preheat.cli import render
    from preheat.core.settings import get_settings

    console = render.console()
    # The embedded database is migrated here; a Postgres one is the operator's (db upgrade).
    settings, _ = prepare(console, models=False, database=get_settings().database.startswith("sqlite"))
    ways, left = run(writes, settings.home / "bench" / "outbox")
    report = {
        "benchmark": "outbox",
        "host": host(),
        "writes": writes,
        "left_in_outbox": left,
        "ways": [{**vars(way), "per_s": way.per_s} for way in ways],
    }
    table = Table(
        title="history writes: direct, kept while the database is away, replayed",
        title_justify="left",
        caption="one job finish per write; away = connection refused",
        caption_justify="left",
    )
    for header in ("way", "writes", "p50 ms", "p99 ms", "total s", "writes/s"):
        table.add_column(header, justify="left" if header == "way" else "right")
    for way in ways:
        timed = way.p50_ms or way.p99_ms
        table.add_row(
            way.name,
            str(way.writes),
            f"{way.p50_ms:.2f}" if timed else "-",
            f"{way.p99_ms:.2f}" if timed else "-",
            f"{way.total_s:.2f}",
            f"{way.per_s:,.0f}",
        )
    console.print(table)
    console.print(f"{ways[1].writes} kept, {ways[2].writes} replayed, {left} left in the outbox")
    write_report(report, json_path or settings.home / "bench" / "outbox.json", console)
