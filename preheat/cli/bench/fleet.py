"""Benchmarks on real worker processes: the first request to a fresh worker (gated vs not)
and the fan-out of one warmup to N workers. Behind `preheat bench first-request | fanout`.

Both start `celery -A preheat worker` processes on the configured stack (the embedded
default or Redis + Postgres) exactly as a deployment does, so what they time includes the
broker, the history writes and the process start that users see.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from preheat.cli.bench.common import worker_env, worker_name
from preheat.cli.lazy import get_settings
from preheat.core import processes
from preheat.fleet import registry
from preheat.history import service
from preheat.history.db import session_scope

# First request -------------------------------------------------------------------------


@dataclass(frozen=True)
class FirstRequestRound:
    gated: bool
    first_ttft_ms: float  # measured by the worker, from taking the request to its first token
    first_answered_s: float  # seen by the client, from the worker's launch to the answer
    first_cached_tokens: int
    steady_ttft_ms: float  # median of the requests after it
    steady_requests: int

    @property
    def first_over_steady(self) -> float:
        return self.first_ttft_ms / self.steady_ttft_ms


def first_request_round(
    template: str, user_input: str, gated: bool, steady_requests: int, log_dir: Path, timeout_s: float
) -> FirstRequestRound:
    """Start a fresh worker, send one request the moment it is launched, then more."""
    from preheat.celery.app import app

    def ask() -> dict:
        pending = app.send_task(
            "preheat.infer", kwargs={"template": template, "user_input": user_input, "max_tokens": 1}
        )
        return pending.get(timeout=timeout_s)

    env = worker_env(PREHEAT_GATE_INFERENCE="true" if gated else "false")
    nodename = worker_name("gated" if gated else "ungated")
    launched = time.perf_counter()
    worker = processes.start_worker(nodename, env, log_dir)
    with processes.running(worker):
        first = ask()
        answered_s = time.perf_counter() - launched
        steady = [ask()["ttft_ms"] for _ in range(steady_requests)]
    return FirstRequestRound(
        gated, first["ttft_ms"], answered_s, first["cached_tokens"], statistics.median(steady), steady_requests
    )


def summarise_first_requests(rounds: list[FirstRequestRound], target: float) -> dict:
    rows = []
    for gated in (True, False):
        mine = [r for r in rounds if r.gated == gated]
        if not mine:
            continue
        first = statistics.median(r.first_ttft_ms for r in mine)
        steady = statistics.median(r.steady_ttft_ms for r in mine)
        rows.append(
            {
                "gated": gated,
                "rounds": len(mine),
                "first_ttft_ms": first,
                "steady_ttft_ms": steady,
                "first_over_steady": first / steady,
                "first_answered_s": statistics.median(r.first_answered_s for r in mine),
                "first_cached_tokens": statistics.median(r.first_cached_tokens for r in mine),
            }
        )
    gated_row = next((row for row in rows if row["gated"]), None)
    return {
        "rows": rows,
        "rounds": [asdict(r) | {"first_over_steady": r.first_over_steady} for r in rounds],
        "target": {
            "first_over_steady": f"<= {target}",
            "met": gated_row is not None and gated_row["first_over_steady"] <= target,
        },
    }


# Fan-out -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FanoutRow:
    workers: int
    total_s: float  # from `preheat warm` (dispatch) to every job recorded final
    slowest_worker_s: float  # the longest one worker spent on its jobs, as history records
    statuses: dict[str, int]

    @property
    def total_over_slowest(self) -> float:
        return self.total_s / self.slowest_worker_s


def fanout_round(count: int, templates: list[str] | None, log_dir: Path, timeout_s: float) -> FanoutRow:
    from preheat.fleet.dispatch import dispatch_warmup, prime_dispatch

    names = [worker_name(f"fan{count}") for _ in range(count)]
    # Each worker gets its share of the CPUs, as a pod gets its CPU request: N processes
    # each spinning up every core's worth of OpenMP threads measure oversubscription.
    threads = str(max(1, (os.cpu_count() or 1) // count))
    workers = [processes.start_worker(name, worker_env(OMP_NUM_THREADS=threads), log_dir) for name in names]
    with processes.running(*workers):
        processes.poll(lambda: _all_ready(names), timeout_s, 0.2, f"{count} worker(s) ready")
        prime_dispatch()  # a dispatcher's connections are open before the warmup it sends
        started = time.perf_counter()
        dispatched = dispatch_warmup(templates=templates, workers=names, requested_by="preheat bench fanout")
        run = processes.poll(lambda: _finished(dispatched.run_id), timeout_s, 0.02, "every job final")
        total_s = time.perf_counter() - started
    spans = {}
    for job in run.jobs:
        begin, end = spans.get(job.target, (job.started_at, job.finished_at))
        spans[job.target] = (min(begin, job.started_at or begin), max(end, job.finished_at))
    slowest = max((end - begin).total_seconds() for begin, end in spans.values())
    statuses: dict[str, int] = {}
    for job in run.jobs:
        statuses[str(job.status)] = statuses.get(str(job.status), 0) + 1
    return FanoutRow(count, total_s, slowest, statuses)


def median_fanout(rows: list[FanoutRow]) -> FanoutRow:
    """Median total and slowest over rounds of one worker count; statuses summed."""
    statuses: dict[str, int] = {}
    for row in rows:
        for status, count in row.statuses.items():
            statuses[status] = statuses.get(status, 0) + count
    return FanoutRow(
        rows[0].workers,
        statistics.median(r.total_s for r in rows),
        statistics.median(r.slowest_worker_s for r in rows),
        statuses,
    )


def _all_ready(names: list[str]) -> bool:
    with session_scope() as session:
        ready = {w.nodename for w in registry.live_workers(session, get_settings().worker_dead_after_s) if w.ready}
    return set(names) <= ready


def _finished(run_id: uuid.UUID):
    with session_scope() as session:
        run = service.get_run(session, run_id)
        return run if all(job.status.is_final for job in run.jobs) else None
