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
import itertools
import json
import math
import os
import random
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.markup import escape

from preheat.cli.bench import servers, tables
from preheat.cli.bench.common import dev_model, host, prepare, worker_env, worker_name, write_report
from preheat.core.errors import ConfigError

CALLER_CORES_TARGET = 0.1  # what 16 callers' result wait may cost their process
MODES = ("batch", "one-at-a-time", "no-prefix-cache", "llama-server", "transformers", "celery")
USER_INPUTS = (
    "Where is my parcel? It was due on Monday.",
    "Summarise: the launch moved to March, QA goes to Dana, the budget stays.",
    "My order arrived damaged. What are my options?",
    "Can you explain what this function returns when the list is empty?",
)
# The targets, on the real model at one precision on both sides: against llama-server at 1
# and 16 users, and no step back against transformers' continuous batching.
PEER_TOKENS_TARGET = 1.0  # × llama-server's tokens/s, at 1 and at 16 users
TOKENS_TARGET = 2.6  # × transformers serve --continuous-batching, at 16 users
TTFT_P50_TARGETS = {16: 3.0, 32: 5.0}  # users: × the single user's TTFT p50, same server (reported)
TARGET_USERS = 16


@dataclass
class Answer:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    total_s: float = 0.0
    error: str | None = None


@dataclass
class Row:
    mode: str
    load: str  # "closed N users" | "poisson R/s"
    users: int
    requests: int
    errors: int
    wall_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tokens_per_s: float
    requests_per_s: float
    # Celery only: the caller's wait for the result, and the worker's own time for it.
    client_p50_ms: float | None = None
    worker_p50_ms: float | None = None
    client_over_worker_p50_ms: float | None = None
    # Cores the calling process spent while its users waited (the result backend's wait).
    caller_cores: float | None = None
    first_error: str | None = None  # what the first failed request said


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
    json_path: Path | None,
) -> None:
    from preheat.cli import render

    wanted_modes = _names(modes, MODES, "--modes")
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
    report = _report(shape, dtype, rows, skipped, max_tokens)
    console.print(tables.load_table(report))
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
                "user_input": _input(k),
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
    row = _row("celery", f"closed {users} users", users, answers, wall_s)
    row.caller_cores = (time.process_time() - cpu_began) / wall_s
    if waits:
        row.client_p50_ms = _pct([c for c, _ in waits], 50)
        row.worker_p50_ms = _pct([w for _, w in waits], 50)
        row.client_over_worker_p50_ms = _pct([c - w for c, w in waits], 50)
    return row


# The load -----------------------------------------------------------------------------


def chat(client, url: str, model: str, system_prompt: str, user_input: str, max_tokens: int) -> Answer:
    """One streamed chat completion, timed from the client's side."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": user_input}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer, started, arrivals = Answer(), time.perf_counter(), []
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                answer.error = f"{response.status_code}: {response.read().decode()[:200]}"
                return answer
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    answer.tokens = event["usage"].get("completion_tokens", 0)
                if "error" in event:
                    answer.error = str(event["error"])[:200]
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        arrivals.append(time.perf_counter())
    except Exception as exc:  # a transport failure is this request's error, counted
        answer.error = f"{type(exc).__name__}: {exc}"[:200]
    answer.total_s = time.perf_counter() - started
    if arrivals:
        answer.ttft_s = arrivals[0] - started
        answer.gaps_s = [b - a for a, b in itertools.pairwise(arrivals)]
        answer.tokens = answer.tokens or len(arrivals)  # a server that reports no usage
    elif answer.error is None:
        answer.error = "no content"
    return answer


def closed_loop(mode, url, model, system_prompts, users: int, per_user: int, max_tokens: int) -> Row:
    import httpx

    answers: list[Answer] = []
    lock = threading.Lock()
    start = threading.Barrier(users)

    def user(index: int) -> None:
        with httpx.Client(timeout=600) as client:
            start.wait()
            for turn in range(per_user):
                k = index * per_user + turn
                got = chat(client, url, model, system_prompts[k % len(system_prompts)], _input(k), max_tokens)
                with lock:
                    answers.append(got)

    began = time.perf_counter()
    _run_threads([threading.Thread(target=user, args=(i,)) for i in range(users)])
    return _row(mode, f"closed {users} users", users, answers, time.perf_counter() - began)


def open_loop(mode, url, model, system_prompts, rate: float, arrivals: int, max_tokens: int) -> Row:
    """Poisson arrivals at `rate` per second (a fixed seed: every mode gets the same times)."""
    import httpx

    gaps = random.Random(7).expovariate
    answers: list[Answer] = []
    lock = threading.Lock()
    client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=arrivals))

    def one(k: int) -> None:
        got = chat(client, url, model, system_prompts[k % len(system_prompts)], _input(k), max_tokens)
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
    return _row(mode, f"poisson {rate:g}/s", 0, answers, time.perf_counter() - began)


def _turns(users: int, per_user: int) -> int:
    """Requests each user sends: at least 8 in all, so a percentile of few users has samples."""
    return max(per_user, math.ceil(8 / users))


def _input(k: int) -> str:
    return f"{USER_INPUTS[k % len(USER_INPUTS)]} (request {k})"


def _run_threads(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _row(mode: str, load: str, users: int, answers: list[Answer], wall_s: float) -> Row:
    good = [a for a in answers if a.error is None and a.ttft_s is not None]
    ttfts = [a.ttft_s * 1000 for a in good]
    gaps = [g * 1000 for a in good for g in a.gaps_s]
    failed = next((a.error for a in answers if a.error is not None), None)
    return Row(
        mode,
        load,
        users,
        len(answers),
        len(answers) - len(good),
        wall_s,
        _pct(ttfts, 50),
        _pct(ttfts, 99),
        _pct(gaps, 50),
        _pct(gaps, 99),
        sum(a.tokens for a in good) / wall_s if wall_s else 0.0,
        len(good) / wall_s if wall_s else 0.0,
        first_error=failed,
    )


def _pct(values: list[float], p: int) -> float:
    """The nearest-rank percentile."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


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


def over_single(row: Row, rows: list[Row]) -> float | None:
    """The row's TTFT p50 over its server's single user's (closed 1 users), where measured:
    how much longer each user waits for the others (the target at 16 users is 3x)."""
    single = next((r for r in rows if r.mode == row.mode and r.load == "closed 1 users"), None)
    if single is None or not single.ttft_p50_ms or math.isnan(row.ttft_p50_ms):
        return None
    return row.ttft_p50_ms / single.ttft_p50_ms


def verdicts(rows: list[Row], skipped: dict[str, str]) -> list[str]:
    def at(mode: str, load: str) -> Row | None:
        return next((r for r in rows if r.mode == mode and r.load == load), None)

    lines, target = [], f"closed {TARGET_USERS} users"
    for row in (r for r in rows if r.mode == "celery" and r.client_p50_ms is not None):
        limit = 1.5 * row.worker_p50_ms + 20
        lines.append(
            f"preheat.infer, {row.load}: the caller waits {row.client_p50_ms:.1f} ms (p50) for the worker's "
            f"{row.worker_p50_ms:.1f} ms (target ≤ 1.5× + 20 ms = {limit:.1f}: {_met(row.client_p50_ms <= limit)})"
        )
        lines.append(
            f"preheat.infer, {row.load}: waiting took {row.caller_cores:.2f} of the caller's cores "
            f"(target ≤ {CALLER_CORES_TARGET}: {_met(row.caller_cores <= CALLER_CORES_TARGET)})"
        )
    for load in ("closed 1 users", target):
        ours, peer = at("batch", load), at("llama-server", load)
        if ours is None or peer is None:
            continue
        ratio = ours.tokens_per_s / peer.tokens_per_s if peer.tokens_per_s else float("inf")
        lines.append(
            f"tokens/s, {load}: {ours.tokens_per_s:.1f} vs llama-server {peer.tokens_per_s:.1f} = {ratio:.2f}× "
            f"(target ≥ {PEER_TOKENS_TARGET}: {_met(ratio >= PEER_TOKENS_TARGET)})"
        )
        lines.append(
            f"TTFT p50, {load}: {ours.ttft_p50_ms:.1f} ms vs llama-server {peer.ttft_p50_ms:.1f} ms "
            f"(target ≤ theirs: {_met(ours.ttft_p50_ms <= peer.ttft_p50_ms)})"
        )
        if load == target:
            lines.append(
                f"TTFT p99, {load}: {ours.ttft_p99_ms:.1f} ms vs llama-server {peer.ttft_p99_ms:.1f} ms "
                f"(target ≤ theirs: {_met(ours.ttft_p99_ms <= peer.ttft_p99_ms)})"
            )
    if "llama-server" in skipped:
        lines.append(f"llama-server not measured: {skipped['llama-server']}")
    ours, single = at("batch", target), at("batch", "closed 1 users")
    if ours is None:
        return [*lines, f"batch at {TARGET_USERS} users not measured: no verdict on the targets at that load"]
    if (theirs := at("transformers", target)) is not None:
        ratio = ours.tokens_per_s / theirs.tokens_per_s if theirs.tokens_per_s else float("inf")
        lines.append(
            f"tokens/s at {TARGET_USERS} users: {ours.tokens_per_s:.1f} vs transformers serve --continuous-batching "
            f"{theirs.tokens_per_s:.1f} = {ratio:.2f}× (target ≥ {TOKENS_TARGET}: {_met(ratio >= TOKENS_TARGET)})"
        )
        lines.append(
            f"TTFT p99 at {TARGET_USERS} users: {ours.ttft_p99_ms:.1f} ms vs {theirs.ttft_p99_ms:.1f} ms "
            f"(target ≤ theirs: {_met(ours.ttft_p99_ms <= theirs.ttft_p99_ms)})"
        )
    else:
        lines.append(f"transformers serve not measured ({skipped.get('transformers', 'not asked for')})")
    for users, target in TTFT_P50_TARGETS.items():
        if single is not None and (row := at("batch", f"closed {users} users")) is not None:
            ratio = row.ttft_p50_ms / single.ttft_p50_ms
            lines.append(
                f"TTFT p50 at {users} users: {row.ttft_p50_ms:.1f} ms = {ratio:.2f}× the single user's "
                f"{single.ttft_p50_ms:.1f} ms (target ≤ {target}: {_met(ratio <= target)})"
            )
    lines.append(
        f"ITL at {TARGET_USERS} users: p99 {ours.itl_p99_ms:.1f} ms, p50 {ours.itl_p50_ms:.1f} ms "
        "(a pre-fill rides in the decode steps: the p99 is a step with a chunk in it)"
    )
    if (alone := at("one-at-a-time", target)) is not None and alone.tokens_per_s:
        lines.append(
            f"batching vs one at a time at {TARGET_USERS} users: {ours.tokens_per_s / alone.tokens_per_s:.2f}×"
        )
    if (cold := at("no-prefix-cache", target)) is not None and cold.ttft_p50_ms:
        lines.append(
            f"prefix caching at {TARGET_USERS} users: TTFT p50 {ours.ttft_p50_ms:.1f} ms, "
            f"{cold.ttft_p50_ms:.1f} ms with it off"
        )
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


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
