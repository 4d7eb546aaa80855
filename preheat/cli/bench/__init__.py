"""`preheat bench …`: measurements that print a table and write JSON, side by side in one run.

One module per benchmark (its measurement, table and report); the commands here declare
their options and import the module only when run, so `preheat --help` loads none of them.
"""

from __future__ import annotations

from pathlib import Path

import typer

from preheat.core.errors import ConfigError

COMPILE_MODES = ("auto", "off")  # PREHEAT_COMPILE's values (preheat.core.settings)


def _check_compile_mode(compile_mode: str) -> None:
    """A bench's --compile, refused before anything runs unless it is one PREHEAT_COMPILE takes."""
    if compile_mode not in COMPILE_MODES:
        raise ConfigError(f"--compile must be auto or off, got {compile_mode!r}")


app = typer.Typer(no_args_is_help=True, help="Benchmarks: side-by-side measurements, a table and a JSON file.")


@app.command("ttft")
def ttft_command(
    model: str = typer.Option(None, help="Catalog model to measure (default: the catalog's first)."),
    lengths: str = typer.Option("512,1024,2048", help="System prompt lengths in tokens, comma-separated."),
    repeats: int = typer.Option(9, min=1, max=100, help="Measured rounds; each figure is the median."),
    user_input: str = typer.Option("Where is my parcel?", help="The user's message after the system prompt."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the results (default: HOME/bench/ttft.json)."),
) -> None:
    """TTFT cold (full prefill) vs warm (cached prefix) vs bare (no system prompt), per length."""
    from preheat.cli.bench import ttft as bench

    bench.main(model=model, lengths=lengths, repeats=repeats, user_input=user_input, json_path=json_path)


@app.command("first-request")
def first_request_command(
    template: str = typer.Option(None, help="Template of the requests (default: the catalog's first)."),
    rounds: int = typer.Option(3, min=1, max=20, help="Fresh workers per mode; figures are medians."),
    steady: int = typer.Option(9, min=3, max=100, help="Requests after the first, for the steady state."),
    timeout: float = typer.Option(300.0, min=10.0, help="Seconds to wait for any one answer."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/first-request.json."),
) -> None:
    """Start a fresh worker, send a request the moment it launches, and compare its TTFT with
    the steady state; gated (requests wait until warm) vs ungated, rounds alternating."""
    from preheat.cli.bench import first_request as bench

    bench.main(template=template, rounds=rounds, steady=steady, timeout=timeout, json_path=json_path)


@app.command("start")
def start_command(
    shapes: str = typer.Option(
        "real", help="Models to start, comma-separated: real (SmolLM2-135M-Instruct), 135m, tiny."
    ),
    rounds: int = typer.Option(3, min=1, max=20, help="Launches per shape and store; figures are medians."),
    timeout: float = typer.Option(300.0, min=10.0, help="Seconds to wait for any one stage."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/start.json."),
    compile_mode: str = typer.Option(
        "auto", "--compile", help="auto: eager starts, then a cold compile and a warm compile cache; off: eager only."
    ),
    settle: float = typer.Option(
        20.0, min=0.0, help="Seconds the machine rests after a cold compile, before the limit and the other launches."
    ),
) -> None:
    """Launch a worker and time each stage to its first answer (and SIGTERM to exit), with an
    empty and a warm prefix store, steps eager, compiled cold and restored from a warm
    compile cache, against the start-up limit measured in the same run."""
    from preheat.cli.bench import start as bench

    _check_compile_mode(compile_mode)
    bench.main(
        shapes=shapes, rounds=rounds, timeout=timeout, json_path=json_path, compile_mode=compile_mode, settle_s=settle
    )


@app.command("sleep")
def sleep_command(
    shape: str = typer.Option("real", help="real (SmolLM2-135M-Instruct), or a random 135m or tiny."),
    rounds: int = typer.Option(3, min=1, max=20, help="Sleep and wake rounds per level; figures are medians."),
    timeout: float = typer.Option(300.0, min=10.0, help="Seconds to wait for any one stage."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/sleep.json."),
) -> None:
    """A worker's model put to sleep and woken (levels 1 and 2) against its cold start: wake →
    ready, bytes freed against the weights, the first request after a wake against steady."""
    from preheat.cli.bench import sleep as bench

    bench.main(shape=shape, rounds=rounds, timeout=timeout, json_path=json_path)


@app.command("load")
def load_command(
    shape: str = typer.Option("real", "--model", help="real (SmolLM2-135M-Instruct), or a random 135m or tiny."),
    dtype: str = typer.Option("auto", help="float32, bfloat16, or auto: preheat's choice here, for every server."),
    compile_mode: str = typer.Option("auto", "--compile", help="preheat's PREHEAT_COMPILE: auto or off."),
    users: str = typer.Option("1,4,16,32,64", help="Closed-loop user counts, comma-separated."),
    requests_per_user: int = typer.Option(4, min=1, max=1000, help="Requests each closed-loop user sends."),
    max_tokens: int = typer.Option(32, min=1, max=4096, help="max_tokens of every request."),
    rate: float = typer.Option(4.0, min=0.01, max=10_000, help="Open loop: Poisson arrivals per second."),
    arrivals: int = typer.Option(48, min=1, max=10_000, help="Open loop: how many requests arrive."),
    modes: str = typer.Option(
        "batch,llama-server,transformers",
        help="Servers to load, comma-separated (batch, one-at-a-time, "
        "no-prefix-cache, llama-server, transformers, celery).",
    ),
    transformers_python: Path = typer.Option(
        None, help="Python with transformers' serving extras (default: .bench-venv/bin/python, `make bench-env`)."
    ),
    timeout: float = typer.Option(300.0, min=10.0, help="Seconds to wait for a server to be ready."),
    restart: bool = typer.Option(
        False, "--restart", help="Also restart batch and llama-server: ready, and the first request on a held prompt."
    ),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/load.json."),
) -> None:
    """Many chat users at once on one server: TTFT, inter-token latency, tokens/s and
    requests/s, side by side for preheat (batching, one at a time, prefix caching off),
    llama.cpp's llama-server (built here, the same weights at the same precision) and
    `transformers serve --continuous-batching`."""
    from preheat.cli.bench import load as bench

    if dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"--dtype must be auto, float32 or bfloat16, got {dtype!r}")
    _check_compile_mode(compile_mode)
    bench.main(
        shape=shape,
        dtype=dtype,
        compile_mode=compile_mode,
        users=users,
        requests_per_user=requests_per_user,
        max_tokens=max_tokens,
        rate=rate,
        arrivals=arrivals,
        modes=modes,
        transformers_python=transformers_python,
        timeout=timeout,
        restart=restart,
        json_path=json_path,
    )


@app.command("fanout")
def fanout_command(
    workers: str = typer.Option("1,2,4", help="Worker counts to measure, comma-separated."),
    rounds: int = typer.Option(3, min=1, max=20, help="Fresh fleets per count; figures are medians."),
    template: list[str] = typer.Option(None, "--template", "-t", help="Templates to warm (default: all)."),
    timeout: float = typer.Option(300.0, min=10.0, help="Seconds to wait for workers and jobs."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/fanout.json."),
) -> None:
    """Warm N fresh workers with one `preheat warm` and compare the total time with the
    slowest single worker's own time (what a perfect fan-out would take)."""
    from preheat.cli.bench import fanout as bench

    bench.main(workers=workers, rounds=rounds, template=template, timeout=timeout, json_path=json_path)


@app.command("route")
def route_command(
    workers: int = typer.Option(4, min=2, max=16, help="Workers in the fleet."),
    users: int = typer.Option(8, min=1, max=256, help="Conversations at once."),
    turns: int = typer.Option(4, min=2, max=32, help="Turns per conversation."),
    pinned: int = typer.Option(2, min=1, max=64, help="Templates one worker can pin."),
    factor: int = typer.Option(3, min=1, max=32, help="The catalog holds factor x pinned templates."),
    requests: int = typer.Option(48, min=1, max=10_000, help="Template requests per mode."),
    shape: str = typer.Option("real", help="real (SmolLM2-135M-Instruct), or a random 135m or tiny."),
    words: int = typer.Option(240, min=20, max=4000, help="Words of each system prompt."),
    max_tokens: int = typer.Option(8, min=1, max=256, help="Tokens per answer."),
    rows: int = typer.Option(4, min=1, max=64, help="PREHEAT_MAX_RUNNING_REQUESTS of each worker."),
    timeout: float = typer.Option(300.0, min=10.0, help="Seconds to wait for the fleet."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/route.json."),
) -> None:
    """Routed against the shared queue alone, one fleet, one run: conversations' later turns
    (cache share, TTFT) and a catalog spread across workers (from a pinned prefix, queues)."""
    from preheat.cli.bench import route as bench

    if shape not in ("real", "135m", "tiny"):
        raise typer.BadParameter(f"--shape must be real, 135m or tiny, not {shape!r}")
    bench.main(workers, users, turns, pinned, factor, requests, shape, words, max_tokens, rows, timeout, json_path)


@app.command("beat")
def beat_command(
    slots: int = typer.Option(12, min=2, max=16, help="Slots to fire, one per schedule."),
    spacing: int = typer.Option(3, min=1, max=10, help="Seconds between fire times (all within a minute)."),
    kill_after: int = typer.Option(3, min=1, help="Kill the leading beat after this many slots fired."),
    template: str = typer.Option(None, help="Template each slot warms (default: the catalog's first)."),
    timeout: float = typer.Option(120.0, min=10.0, help="Seconds to wait for processes and slots."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/beat.json."),
) -> None:
    """Scheduled warmups fired by two real beats, the leader killed midway: how late each slot
    fired, before the kill, during the takeover and after, and how long the takeover took."""
    from preheat.cli.bench import beat as bench

    bench.main(
        slots=slots, spacing=spacing, kill_after=kill_after, template=template, timeout=timeout, json_path=json_path
    )


@app.command("connect")
def connect_command(
    template: str = typer.Option(
        None, help="Template of the request (default: the catalog's first, or the endpoint's)."
    ),
    endpoint: str = typer.Option(
        None, help="Measure this catalog endpoint (your vLLM or API) instead of a local preheat serve."
    ),
    rounds: int = typer.Option(60, min=1, max=500, help="Interleaved rounds; figures are medians."),
    http2: bool = typer.Option(False, "--http2", help="Offer HTTP/2 (preheat serve answers HTTP/1.1)."),
    timeout: float = typer.Option(120.0, min=10.0, help="Seconds to wait for the server."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/connect.json."),
) -> None:
    """First request with a fresh client vs through a pre-opened pool vs steady state,
    against `preheat serve` over TLS on loopback (a CA made for the run)."""
    from preheat.cli.bench import connect as bench

    bench.main(template=template, endpoint=endpoint, rounds=rounds, http2=http2, timeout=timeout, json_path=json_path)


@app.command("outbox")
def outbox_command(
    writes: int = typer.Option(500, min=10, max=100_000, help="History writes per way."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/outbox.json."),
) -> None:
    """What the history outbox costs: a job's finish written directly, the same write while the
    database is away (kept on disk), and the replay once it is back, on the configured database."""
    from preheat.cli.bench import outbox as bench

    bench.main(writes=writes, json_path=json_path)


@app.command("history")
def history_command(
    jobs: int = typer.Option(1_000_000, min=1000, max=100_000_000, help="Jobs in the record (four a run)."),
    days: int = typer.Option(365, min=2, max=36_500, help="Days the record spans."),
    retention_days: int = typer.Option(90, min=1, max=36_500, help="What the prune keeps, in days."),
    repeats: int = typer.Option(9, min=1, max=100, help="Timed runs of each query; the median is shown."),
    database_url: str = typer.Option(
        None, help="PostgreSQL server to make the scratch database on (default: PREHEAT_DATABASE_URL's)."
    ),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/history.json."),
) -> None:
    """`preheat history`, `preheat workers` and the history's writes on a large record, before
    and after the indexes of migration 0008, with each statement's plan; then the prune to
    the retention. On a scratch database of its own, dropped at the end."""
    from preheat.cli.bench import history as bench

    bench.main(
        jobs=jobs,
        days=days,
        retention_days=retention_days,
        repeats=repeats,
        server_url=database_url,
        json_path=json_path,
    )


@app.command("memory")
def memory_command(
    shape: str = typer.Option("135m", help="Dev model shape: tiny or 135m (SmolLM-135M's)."),
    templates: int = typer.Option(10, min=1, max=1000, help="Templates pre-filled and kept."),
    tokens: int = typer.Option(500, min=2, max=100_000, help="Tokens of each template."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/memory.json."),
) -> None:
    """Resident memory a cached template costs against its KV bytes: tensors in the heap
    (before) vs one slab outside it (production), each in a fresh process."""
    from preheat.cli.bench import memory as bench

    if shape not in ("tiny", "135m"):
        raise typer.BadParameter(f"unknown shape {shape!r}: tiny or 135m", param_hint="--shape")
    bench.main(shape=shape, templates=templates, tokens=tokens, json_path=json_path)


@app.command("limit")
def limit_command(
    shape: str = typer.Option("real", "--model", help="real (SmolLM2-135M-Instruct), or a random 135m or tiny."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/limit/limit.json."),
) -> None:
    """A decode step against the hardware: the weight bytes over the measured memory bandwidth
    (one row), the step's FLOPs over the measured matmul throughput (16 rows), and preheat's
    step beside both (PREHEAT_DTYPE and PREHEAT_COMPILE as a worker takes them)."""
    from preheat.cli.bench import limit as bench

    bench.main(shape=shape, json_path=json_path)


@app.command("agreement")
def agreement_command(
    shape: str = typer.Option("real", "--model", help="real (SmolLM2-135M-Instruct), or a random 135m or tiny."),
    dtypes: str = typer.Option("bfloat16,float32", help="preheat's dtypes to measure, comma-separated."),
    prompts: int = typer.Option(16, min=1, max=256, help="Chat prompts (the catalog's system prompts, varied users)."),
    max_tokens: int = typer.Option(32, min=1, max=1024, help="Greedy tokens of each answer."),
    compile_mode: str = typer.Option("auto", "--compile", help="preheat's PREHEAT_COMPILE: auto or off."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/agreement/agreement.json."),
) -> None:
    """preheat's greedy answers against transformers in float32, per position: top-1
    agreement and log-probability gaps (teacher-forced), and whole answers compared, with the
    requests batched together and alone."""
    from preheat.cli.bench import agreement as bench

    _check_compile_mode(compile_mode)
    bench.main(
        shape=shape,
        dtypes=dtypes,
        prompts=prompts,
        max_tokens=max_tokens,
        compile_mode=compile_mode,
        json_path=json_path,
    )


@app.command("lora")
def lora_command(
    shape: str = typer.Option("real", "--model", help="real (SmolLM2-135M-Instruct), or a random 135m or tiny."),
    rounds: int = typer.Option(
        3, min=1, max=20, help="Rounds: first requests per way (fresh cold adapters each), and runs of every spread."
    ),
    requests_per_user: int = typer.Option(2, min=1, max=100, help="Requests each of the 16 users sends."),
    max_tokens: int = typer.Option(32, min=1, max=4096, help="max_tokens of every request."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/lora/lora.json."),
) -> None:
    """LoRA adapters: the first request to a cold adapter against one warmed ahead and the
    base; one adapter's load; 16 users over 1, 4 and 16 adapters against 16 on the base."""
    from preheat.cli.bench import lora as bench

    bench.main(
        shape=shape, adapters=16, rounds=rounds, per_user=requests_per_user, max_tokens=max_tokens, json_path=json_path
    )
