"""`preheat bench load`: many chat users at once against one server, side by side.

Each mode is a fresh server on the same dev model and the same templates' system prompts:
preheat's scheduler, the same scheduler one request at a time (PREHEAT_MAX_RUNNING_REQUESTS=1),
batching with prefix caching off, and `transformers serve --continuous-batching` where its serving
extras are installed (`make bench-env`). Every mode gets the same load: closed loops of 1,
4, 16, 64 users (each sends its next request when its answer is complete), then an open
loop of Poisson arrivals. Requests are streamed chat completions, greedy, as a client
sends them; TTFT is the first content chunk, inter-token latency the gaps after it.

The `celery` mode sends the same users' requests as `preheat.infer` tasks to one worker
(threads pool, the same engine) on the configured stack, and compares each caller's wait
with the time the worker measured for it.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import random
import subprocess
import threading
import time
from dataclasses import asdict
from pathlib import Path

from rich.markup import escape

from preheat.cli.bench import servers, tables
from preheat.cli.bench.chatclient import Answer, Row, chat, new_client, percentile, summarise, user_turn
from preheat.cli.bench.common import dev_model, host, prepare, worker_env, worker_name, write_report
from preheat.cli.bench.loadverdicts import over_single, verdicts
from preheat.core.errors import ConfigError

MODES = ("batch", "one-at-a-time", "no-prefix-cache", "llama-server", "transformers", "celery")


def main(
    shape: str,
    dtype: str,
    compile_mode: str,
    users: str,
    requests_per_user: int,
    max_tokens: int,
    rate: float,
    arrivals: int,
    modes: str,
    transformers_python: Path | None,
    timeout: float,
    restart: bool,
    json_path: Path | None,
) -> None:
    from preheat.cli import render
    from preheat.cli.bench import restart as restarts

    wanted_modes = _names(modes, MODES, "--modes")
    if restart and not set(restarts.SERVERS) & set(wanted_modes):
        raise ConfigError(f"--restart: measured for {' and '.join(restarts.SERVERS)}; --modes has neither")
    user_counts = _counts(users)
    console = render.console()
    exclusive = "the celery mode starts its own worker" if "celery" in wanted_modes else None
    settings, catalog = prepare(console, database="celery" in wanted_modes, models=False, exclusive=exclusive)
    if not catalog.templates:
        raise ConfigError(f"catalog {settings.catalog} has no template: the load needs system prompts")
    # The first template's model and its templates, on the dev model: Celery requests are
    # routed by this process's catalog, so the bench's catalog keeps the model's name.
    model_name = catalog.template(next(iter(catalog.templates))).model
    templates = catalog.templates_of(model_name)
    system_prompts = [catalog.system_prompt(name) for name in templates]
    folder = settings.home / "bench" / "load"
    model_dir = dev_model(folder / "models" / shape, shape, console)
    dtype = _dtype(dtype)
    setup = servers.Setup(model_name, model_dir, dtype, max(user_counts), compile_mode)
    console.print(f"{shape} model in {dtype}; preheat's steps {compile_mode}; {setup.rows} rows (slots)")
    python = transformers_python or Path(".bench-venv/bin/python")
    rows, skipped = [], {}
    for mode in wanted_modes:
        console.print(f"{mode}: starting the server …")
        if mode == "celery":
            rows += _celery_rows(
                model_name,
                model_dir,
                templates,
                catalog,
                folder,
                user_counts,
                requests_per_user,
                max_tokens,
                timeout,
                console,
            )
            continue
        try:
            server = servers.start(mode, setup, templates, catalog, folder, python, timeout)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            skipped[mode] = str(exc)
            console.print(escape(f"{mode}: not measured: {exc}"), highlight=False)
            continue
        try:
            model = server.model
            for count in user_counts:
                turns = _turns(count, requests_per_user)
                rows.append(closed_loop(mode, server.url, model, system_prompts, count, turns, max_tokens))
                console.print(_line(rows[-1]), highlight=False)
            rows.append(open_loop(mode, server.url, model, system_prompts, rate, arrivals, max_tokens))
            console.print(_line(rows[-1]), highlight=False)
        finally:
            server.stop()
    restarted = []
    if restart:
        console.print("restart: each server stopped and started again …")
        restarted = restarts.rows(wanted_modes, setup, templates, catalog, folder, python, timeout, max_tokens)
    report = _report(shape, dtype, rows, skipped, max_tokens)
    report["restart"] = [asdict(row) for row in restarted]
    report["verdicts"] += restarts.verdicts(restarted)
    console.print(tables.load_table(report))
    if restarted:
        console.print(tables.restart_table(report))
    for line in report["verdicts"]:
        console.print(line, highlight=False)
    write_report(report, json_path or settings.home / "bench" / "load.json", console)


def _celery_rows(
    model_name, model_dir, templates, catalog, folder, user_counts, per_user, max_tokens, timeout, console
) -> list[Row]:
    """One worker on the configured stack; each user sends `preheat.infer` and waits for it."""
    from preheat.celery.app import app
    from preheat.core import processes

    console.print("celery: starting a worker …")
    env = worker_env(
        PREHEAT_CATALOG=str(servers.bench_catalog(folder, model_name, model_dir, templates, catalog)),
        PREHEAT_PREFIX_STORE="off",
    )
    worker = processes.start_worker(worker_name("load"), env, folder / "logs")
    rows = []
    with processes.running(worker):
        processes.wait_for_log(worker, f"model {model_name} takes requests", timeout)
        for count in user_counts:
            rows.append(celery_loop(app, templates, count, _turns(count, per_user), max_tokens))
            console.print(_line(rows[-1]), highlight=False)
    return rows


def celery_loop(app, templates: list[str], users: int, per_user: int, max_tokens: int) -> Row:
    answers: list[Answer] = []
    waits: list[tuple[float, float]] = []  # (the caller's ms, the worker's ms)
    lock = threading.Lock()
    start = threading.Barrier(users)

    def user(index: int) -> None:
        start.wait()
        for turn in range(per_user):
            k = index * per_user + turn
            kwargs = {
                "template": templates[k % len(templates)],
                "user_input": user_turn(k),
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            began = time.perf_counter()
            try:
                result = app.send_task("preheat.infer", kwargs=kwargs).get(timeout=600)
            except Exception as exc:
                with lock:
                    answers.append(Answer(error=f"{type(exc).__name__}: {exc}"[:200]))
                continue
            client_ms = (time.perf_counter() - began) * 1000
            with lock:
                answers.append(Answer(result["ttft_ms"] / 1000, [], len(result["token_ids"]), client_ms / 1000))
                waits.append((client_ms, result["total_ms"]))

    began, cpu_began = time.perf_counter(), time.process_time()
    _run_threads([threading.Thread(target=user, args=(i,)) for i in range(users)])
    wall_s = time.perf_counter() - began
    row = summarise("celery", f"closed {users} users", users, answers, wall_s)
    row.caller_cores = (time.process_time() - cpu_began) / wall_s
    if waits:
        row.client_p50_ms = percentile([c for c, _ in waits], 50)
        row.worker_p50_ms = percentile([w for _, w in waits], 50)
        row.client_over_worker_p50_ms = percentile([c - w for c, w in waits], 50)
    return row


# The load -----------------------------------------------------------------------------


def closed_loop(mode, url, model, system_prompts, users: int, per_user: int, max_tokens: int) -> Row:
    answers: list[Answer] = []
    lock = threading.Lock()
    start = threading.Barrier(users)

    def user(index: int) -> None:
        with new_client() as client:
            start.wait()
            for turn in range(per_user):
                k = index * per_user + turn
                got = chat(client, url, model, system_prompts[k % len(system_prompts)], user_turn(k), max_tokens)
                with lock:
                    answers.append(got)

    began = time.perf_counter()
    _run_threads([threading.Thread(target=user, args=(i,)) for i in range(users)])
    return summarise(mode, f"closed {users} users", users, answers, time.perf_counter() - began)


def open_loop(mode, url, model, system_prompts, rate: float, arrivals: int, max_tokens: int) -> Row:
    """Poisson arrivals at `rate` per second (a fixed seed: every mode gets the same times)."""
    gaps = random.Random(7).expovariate
    answers: list[Answer] = []
    lock = threading.Lock()
    client = new_client(connections=arrivals)

    def one(k: int) -> None:
        got = chat(client, url, model, system_prompts[k % len(system_prompts)], user_turn(k), max_tokens)
        with lock:
            answers.append(got)

    threads, began = [], time.perf_counter()
    at = 0.0
    for k in range(arrivals):
        at += gaps(rate)
        time.sleep(max(0.0, began + at - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(k,)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    client.close()
    return summarise(mode, f"poisson {rate:g}/s", 0, answers, time.perf_counter() - began)


def _turns(users: int, per_user: int) -> int:
    """Requests each user sends: at least 8 in all, so a percentile of few users has samples."""
    return max(per_user, math.ceil(8 / users))


def _run_threads(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _line(row: Row) -> str:
    line = (
        f"  {row.mode:16} {row.load:18} {row.tokens_per_s:7.1f} tok/s  TTFT p50 {row.ttft_p50_ms:7.1f} ms "
        f"p99 {row.ttft_p99_ms:7.1f} ms  ITL p50 {row.itl_p50_ms:6.1f} ms  errors {row.errors}"
    )
    if row.client_p50_ms is not None:
        line += f"  caller {row.client_p50_ms:.1f} ms for the worker's {row.worker_p50_ms:.1f} ms"
        line += f", {row.caller_cores:.2f} cores waiting"
    return line


def _dtype(asked: str) -> str:
    """The precision of every server of the run: as asked, or what preheat picks here (auto)."""
    if asked != "auto":
        return asked
    import torch

    from preheat.workers.engine.device import fast_dtype

    return "bfloat16" if fast_dtype(torch.device("cpu")) == torch.bfloat16 else "float32"


def _report(shape: str, dtype: str, rows: list[Row], skipped: dict[str, str], max_tokens: int) -> dict:
    return {
        "benchmark": "load",
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": {**host(), "cpus_usable": len(os.sched_getaffinity(0))},
        "shape": shape,
        "dtype": dtype,
        "max_tokens": max_tokens,
        "rows": [{**asdict(r), "ttft_p50_over_single": over_single(r, rows)} for r in rows],
        "not_measured": skipped,
        "verdicts": verdicts(rows, skipped),
    }


def _names(value: str, allowed: tuple[str, ...], option: str) -> list[str]:
    names = [part.strip() for part in value.split(",") if part.strip()]
    if not names or any(n not in allowed for n in names):
        raise ConfigError(f"{option}: expected a comma-separated list of {', '.join(allowed)} (got {value!r})")
    return names


def _counts(value: str) -> list[int]:
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--users: {value!r} is not a comma-separated list of user counts") from None
    if not counts or min(counts) < 1 or max(counts) > 1024:
        raise ConfigError("--users: every count must be between 1 and 1024")
    return counts
