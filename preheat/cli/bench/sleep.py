"""`preheat bench sleep`: a model asleep and woken against a cold start, side by side in one run.

One real worker on a dev model (the 135M shape by default), its prefixes in a prefix store:
- **cold start**: launch → /health/ready 200 (the store warm, as a restarted replica has it);
- **steady**: the worker's own TTFT of requests from the cached prefix, once warm;
- for each level, each round: `preheat sleep` through the broker (the job's sleep ms and bytes
  freed, and the worker's resident set before and after, read from /proc), then `preheat wake`
  → /health/ready 200 (wake → ready, the wake's own ms, the templates' restore); a request sent
  the moment it is ready (an on-demand wake's user: the wake's probes still run beside it), and
  the first request after the wake's run (what a scheduled wake, its lead learned from wake
  durations, gives the peak's first user), each against steady.
Targets: wake → ready ≤ 0.2× the cold start; level 1 frees ≥ 90 % of the weight bytes from the
process; the first request after a wake ≤ 1.5× steady TTFT.
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
from pathlib import Path

from preheat.cli.bench import tables
from preheat.cli.bench.common import dev_model, host, prepare, worker_env, worker_name, write_report
from preheat.cli.bench.start import _catalog, as_installed
from preheat.core.errors import ConfigError

SHAPES = ("real", "135m", "tiny")
DEMAND_TARGET_MS = 200.0  # a request to a sleeping model starts its wake within this
WAKE_TARGET = 0.2  # wake -> ready, over launch -> ready
FREED_TARGET = 0.9  # level 1: the process's resident set falls by this share of the weights
FIRST_TARGET = 1.5  # the first request after a wake, over steady TTFT
STEADY_REQUESTS = 9


def main(shape: str, rounds: int, timeout: float, json_path: Path | None) -> None:
    from preheat.cli import render

    if shape not in SHAPES:
        raise ConfigError(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    console = render.console()
    settings, catalog = prepare(console, exclusive="bench sleep starts its own worker", models=False)
    if not catalog.templates:
        raise ConfigError(f"catalog {settings.catalog} has no template to pre-fill")
    template = next(iter(catalog.templates))
    spec = catalog.template(template)
    folder = settings.home / "bench" / "sleep"
    model_dir = dev_model(settings.home / "bench" / "start" / "models" / shape, shape, console)
    bench_catalog = _catalog(
        folder / f"{shape}.toml", spec.model, model_dir, template, catalog.system_prompt(template), spec.probe
    )
    env = as_installed(
        worker_env(PREHEAT_CATALOG=str(bench_catalog), PREHEAT_PREFIX_STORE=str(folder / "prefixes" / shape))
    )
    console.print(f"{shape}: a cold start, then {rounds} round(s) of sleep and wake at levels 1 and 2 …")
    report = measure(env, spec.model, template, spec.probe, rounds, timeout, folder / "logs")
    report.update(shape=shape, host=host())
    console.print(tables.sleep_bench_table(report))
    for line in report["verdicts"]:
        console.print(line, highlight=False)
    write_report(report, json_path or settings.home / "bench" / "sleep.json", console)


def measure(env: dict, model: str, template: str, probe: str, rounds: int, timeout: float, logs: Path) -> dict:
    from preheat.core import processes

    name = worker_name("sleep")
    # A first start fills the prefix store, so the measured cold start restores as a wake does.
    with processes.running(processes.start_worker(name, env, logs)) as (first,):
        _ready(processes.health_url(first, timeout), timeout)
    launched = time.perf_counter()
    worker = processes.start_worker(name, env, logs)
    with processes.running(worker):
        health = processes.health_url(worker, timeout)
        _ready(health, timeout)
        cold_s = time.perf_counter() - launched
        steady_ms = statistics.median(_ask(template, probe, timeout)["ttft_ms"] for _ in range(STEADY_REQUESTS))
        rows = [
            _round(worker, name, model, template, probe, level, health, timeout)
            for _ in range(rounds)
            for level in (1, 2)
        ]
    return _report(cold_s, steady_ms, rows)


def _round(worker, name: str, model: str, template: str, probe: str, level: int, health: str, timeout: float) -> dict:
    from preheat.cli.warm import wait_for_run
    from preheat.core.states import WHOLE_MODEL, RunAction
    from preheat.fleet.sleep import dispatch_sleep_wake
    from preheat.workers.sleep import resident_set_bytes

    before = resident_set_bytes(worker.popen.pid)
    slept = dispatch_sleep_wake(RunAction.sleep, models=[model], workers=[name], level=level, requested_by="bench")
    [sleep_job] = wait_for_run(slept.run_id, timeout, show_progress=False).jobs
    if sleep_job.status != "asleep":
        raise RuntimeError(f"the sleep did not happen: {sleep_job.status} {sleep_job.error}")
    after = resident_set_bytes(worker.popen.pid)
    woken_at = time.perf_counter()
    woke = dispatch_sleep_wake(RunAction.wake, models=[model], workers=[name], requested_by="bench")
    _ready(health, timeout)
    wake_ready_s = time.perf_counter() - woken_at
    # A request the moment it is ready (an on-demand wake's user): the wake's probes still run
    # beside it. Then the first after the wake's run, what a scheduled wake's lead delivers.
    at_ready = _ask(template, probe, timeout)
    jobs = {job.template: job for job in wait_for_run(woke.run_id, timeout, show_progress=False).jobs}
    first = _ask(template, probe, timeout)
    weights = sleep_job.bytes_freed - sleep_job.cache_bytes
    demand = _on_demand(name, model, template, probe, level, health, timeout)
    return {
        **demand,
        "level": level,
        "sleep_ms": sleep_job.sleep_ms,
        "weight_bytes": weights,
        "kv_bytes": sleep_job.cache_bytes,
        "rss_before": before,
        "rss_after": after,
        "rss_freed_over_weights": (before - after) / weights,
        "wake_ms": jobs[WHOLE_MODEL].wake_ms,
        "wake_ready_s": wake_ready_s,
        "restore_ms": jobs[template].restore_ms,
        "ttft_warm_after_wake_ms": jobs[template].ttft_warm_ms,
        "first_request_ttft_ms": first["ttft_ms"],
        "at_ready_ttft_ms": at_ready["ttft_ms"],
        "wake_status": str(jobs[template].status),
    }


def _on_demand(name: str, model: str, template: str, probe: str, level: int, health: str, timeout: float) -> dict:
    """Asleep again, a request sent with no wake: how long until the worker's demand run
    exists (the wake started for it: the queue's look, then the run), and until the answer."""
    from sqlalchemy import select

    from preheat.cli.warm import wait_for_run
    from preheat.core.states import RunAction, TriggerKind
    from preheat.fleet.sleep import dispatch_sleep_wake
    from preheat.history.db import session_scope, utcnow
    from preheat.history.models import WarmupRun

    slept = dispatch_sleep_wake(RunAction.sleep, models=[model], workers=[name], level=level, requested_by="bench")
    wait_for_run(slept.run_id, timeout, show_progress=False)
    sent_at, started = utcnow(), time.perf_counter()
    _ask(template, probe, timeout)  # waits in the queue until the worker wakes for it
    answered_s = time.perf_counter() - started
    with session_scope() as session:
        run = session.scalars(
            select(WarmupRun)
            .where(WarmupRun.trigger == TriggerKind.demand, WarmupRun.created_at >= sent_at)
            .order_by(WarmupRun.created_at)
        ).first()
        # SQLite gives its timestamps back without their zone: they are UTC, as written.
        created = None if run is None else run.created_at.replace(tzinfo=run.created_at.tzinfo or dt.UTC)
        started_ms = (created - sent_at).total_seconds() * 1000 if created is not None else None
        woke_run = run.id if run is not None else None
    if woke_run is not None:
        wait_for_run(woke_run, timeout, show_progress=False)  # its probes done before the next round
    _ready(health, timeout)
    return {"demand_wake_started_ms": started_ms, "demand_answer_s": answered_s}


def _report(cold_s: float, steady_ms: float, rows: list[dict]) -> dict:
    summary, verdicts = [], []
    for level in (1, 2):
        mine = [row for row in rows if row["level"] == level]
        median = {
            key: statistics.median(row[key] for row in mine)
            for key in mine[0]
            if key != "wake_status" and all(row[key] is not None for row in mine)
        }
        median.update(
            wake_over_cold=median["wake_ready_s"] / cold_s,
            first_over_steady=median["first_request_ttft_ms"] / steady_ms,
            at_ready_over_steady=median["at_ready_ttft_ms"] / steady_ms,
        )
        summary.append(median)
        verdicts.append(
            f"level {level}: wake → ready {median['wake_ready_s']:.2f} s = {median['wake_over_cold']:.2f}× the cold "
            f"start's {cold_s:.2f} s (target ≤ {WAKE_TARGET}: {_met(median['wake_over_cold'] <= WAKE_TARGET)}); "
            f"first request after the wake {median['first_request_ttft_ms']:.1f} ms = "
            f"{median['first_over_steady']:.2f}× steady {steady_ms:.1f} ms "
            f"(target ≤ {FIRST_TARGET}: {_met(median['first_over_steady'] <= FIRST_TARGET)}); "
            f"one sent the moment it is ready, beside the wake's probes: {median['at_ready_over_steady']:.2f}×"
        )
    for level, median in zip((1, 2), summary, strict=True):
        started = median.get("demand_wake_started_ms")
        verdicts.append(
            f"level {level}, a request to the sleeping model: its wake started {started:.0f} ms after it was sent "
            f"(target ≤ {DEMAND_TARGET_MS:.0f} ms: {_met(started <= DEMAND_TARGET_MS)}); answered after "
            f"{median['demand_answer_s']:.2f} s"
            if started is not None
            else f"level {level}, a request to the sleeping model: no demand run found"
        )
    level_one = summary[0]["rss_freed_over_weights"]
    verdicts.append(
        f"level 1 gives back {100 * level_one:.0f} % of the weight bytes from the process's resident set "
        f"(target ≥ {100 * FREED_TARGET:.0f} %: {_met(level_one >= FREED_TARGET)})"
    )
    return {
        "cold_start_s": cold_s,
        "steady_ttft_ms": steady_ms,
        "rounds": len(rows) // 2,
        "rows": rows,
        "summary": summary,
        "verdicts": verdicts,
    }


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _ready(health: str, timeout: float) -> None:
    import httpx

    from preheat.core import processes

    with httpx.Client(timeout=5) as client:
        processes.poll(lambda: client.get(f"{health}/health/ready").status_code == 200, timeout, 0.05, "ready")


def _ask(template: str, probe: str, timeout: float) -> dict:
    from preheat.celery.app import app

    return app.send_task("preheat.infer", kwargs={"template": template, "user_input": probe, "max_tokens": 1}).get(
        timeout=timeout
    )
