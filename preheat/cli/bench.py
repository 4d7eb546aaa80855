"""`preheat bench …`: measurements that print a table and write JSON, side by side in one run."""

from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path

import typer

from preheat.errors import ConfigError

app = typer.Typer(no_args_is_help=True, help="Benchmarks: side-by-side measurements, a table and a JSON file.")

SAVED_TARGET_PCT = 95.0  # at the longest system prompt
OVERHEAD_TARGET_PCT = 2.0  # reuse (lookup + id check + clone) against the warm TTFT


def _lengths(value: str) -> list[int]:
    try:
        lengths = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of token counts") from None
    if not lengths or lengths[0] < 2:
        raise typer.BadParameter("every length must be at least 2 tokens")
    return lengths


@app.command()
def ttft(
    model: str = typer.Option(None, help="Catalog model to measure (default: the catalog's first)."),
    lengths: str = typer.Option("512,1024,2048", help="System prompt lengths in tokens, comma-separated."),
    repeats: int = typer.Option(9, min=1, max=100, help="Measured rounds; each figure is the median."),
    user_input: str = typer.Option("Where is my parcel?", help="The user's message after the system prompt."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the results (default: HOME/bench/ttft.json)."),
) -> None:
    """TTFT cold (full prefill) vs warm (cached prefix) vs bare (no system prompt), per length."""
    from preheat.catalog import load_catalog
    from preheat.cli import render
    from preheat.cli.dev import build_missing_models
    from preheat.settings import get_settings
    from workers.bench import measure_ttft, system_prompt_ids
    from workers.devmodel import _corpus
    from workers.models import ModelRegistry, ModelSource

    settings, console = get_settings(), render.console()
    catalog = load_catalog(settings.catalog)
    name = model or next(iter(catalog.models), None)
    if name is None:
        raise ConfigError(f"catalog {settings.catalog} names no model to measure")
    spec = catalog.model(name)  # an unknown name is one clear error, before any work
    build_missing_models(catalog, console)
    resident, load_ms = ModelRegistry(settings.device).ensure(
        ModelSource(name, catalog.model_path(name), spec.dtype, spec.revision)
    )
    wanted = _lengths(lengths)
    if resident.max_context and wanted[-1] + 64 > resident.max_context:
        raise ConfigError(
            f"a {wanted[-1]}-token system prompt leaves no room in {name}'s context of {resident.max_context}"
        )
    source_text = "".join(_corpus(40 * wanted[-1]))
    console.print(
        f"measuring {name} on {resident.placement.describe()} (loaded in {load_ms:,.0f} ms): "
        f"{len(wanted)} lengths × {repeats} rounds …"
    )
    rows = [measure_ttft(resident, system_prompt_ids(resident, n, source_text), repeats, user_input) for n in wanted]

    report = _report(name, resident, repeats, user_input, rows)
    console.print(render.ttft_table(report))
    for line in report["verdicts"]:
        console.print(line, highlight=False)
    path = json_path or settings.home / "bench" / "ttft.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {path}")


def _report(name: str, resident, repeats: int, user_input: str, rows) -> dict:
    import torch
    import transformers

    config = resident.model.config
    longest = rows[-1]
    worst_overhead = max(row.reuse_overhead_pct for row in rows)
    targets = {
        f"saved_at_{longest.system_tokens}_pct": {
            "target": f">= {SAVED_TARGET_PCT}",
            "measured": longest.saved_pct,
            "met": longest.saved_pct >= SAVED_TARGET_PCT,
        },
        "reuse_overhead_pct": {
            "target": f"<= {OVERHEAD_TARGET_PCT}",
            "measured": worst_overhead,
            "met": worst_overhead <= OVERHEAD_TARGET_PCT,
        },
        "same_first_token": {"target": "all", "met": all(row.same_first_token for row in rows)},
    }
    verdicts = [
        f"saved at {longest.system_tokens} tokens: {longest.saved_pct:.1f}% (target ≥ {SAVED_TARGET_PCT:.0f}%: "
        f"{'met' if targets[f'saved_at_{longest.system_tokens}_pct']['met'] else 'NOT met'})",
        f"reuse overhead: at most {worst_overhead:.2f}% of warm TTFT (target ≤ {OVERHEAD_TARGET_PCT:.0f}%: "
        f"{'met' if targets['reuse_overhead_pct']['met'] else 'NOT met'})",
        f"warm / bare at {longest.system_tokens} tokens: {longest.warm_over_bare:.2f} (1.0 = the system prompt "
        f"costs nothing)",
    ]
    return {
        "benchmark": "ttft",
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": {
            "name": name,
            "path": resident.path,
            "architecture": config.model_type,
            "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "parameters": sum(p.numel() for p in resident.model.parameters()),
        },
        "device": resident.placement.describe(),
        "host": {
            "machine": platform.machine(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
        },
        "repeats": repeats,
        "user_input": user_input,
        "rows": [row.as_dict() for row in rows],
        "targets": targets,
        "verdicts": verdicts,
    }


FIRST_REQUEST_TARGET = 1.1  # first request TTFT / steady state, on a gated worker
FANOUT_TARGET = 1.2  # fleet warmup time / the slowest single worker's


def _bench_setup(console, why: str):
    """Settings and catalog, the dev model built if missing, the DB migrated, no stray workers."""
    from preheat import migrate
    from preheat.catalog import load_catalog
    from preheat.cli.dev import build_missing_models
    from preheat.cli.fleetbench import ensure_no_live_workers
    from preheat.settings import get_settings

    settings = get_settings()
    catalog = load_catalog(settings.catalog)
    build_missing_models(catalog, console)
    settings.home.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(settings.database)
    ensure_no_live_workers(why)
    return settings, catalog


def _write(report: dict, path: Path, console) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {path}")


def _host() -> dict:
    import os

    from preheat.settings import get_settings

    settings = get_settings()
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "stack": "embedded (filesystem broker, SQLite)" if settings.is_embedded else "broker + database from env",
    }


@app.command("first-request")
def first_request(
    template: str = typer.Option(None, help="Template of the requests (default: the catalog's first)."),
    rounds: int = typer.Option(3, min=1, max=20, help="Fresh workers per mode; figures are medians."),
    steady: int = typer.Option(9, min=3, max=100, help="Requests after the first, for the steady state."),
    timeout: float = typer.Option(300.0, min=10.0, help="Seconds to wait for any one answer."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/first-request.json."),
) -> None:
    """Start a fresh worker, send a request the moment it launches, and compare its TTFT with
    the steady state; gated (requests wait until warm) vs ungated, rounds alternating."""
    from rich.table import Table

    from preheat.cli import render
    from preheat.cli.fleetbench import first_request_round, summarise_first_requests

    console = render.console()
    settings, catalog = _bench_setup(console, "bench first-request starts its own workers")
    name = template or next(iter(catalog.templates), None)
    if name is None:
        raise ConfigError(f"catalog {settings.catalog} has no template to request")
    spec = catalog.template(name)
    console.print(
        f"first request vs steady state, template {name!r} on {spec.model}: {rounds} round(s) × "
        "gated / ungated, a fresh worker each …"
    )
    measured = []
    for i in range(rounds):
        for gated in (True, False):
            measured.append(
                first_request_round(name, spec.probe, gated, steady, settings.home / "bench" / "logs", timeout)
            )
            console.print(
                f"  round {i + 1} {'gated' if gated else 'ungated'}: first "
                f"{measured[-1].first_ttft_ms:,.1f} ms, steady {measured[-1].steady_ttft_ms:,.1f} ms"
            )
    report = {
        "benchmark": "first-request",
        "template": name,
        "model": spec.model,
        "host": _host(),
        "steady_requests": steady,
        **summarise_first_requests(measured, FIRST_REQUEST_TARGET),
    }
    table = Table(
        title=f"first request to a fresh worker vs steady state · {spec.model}, template {name}",
        title_justify="left",
        caption="TTFT in ms as the worker measures it (taking the request → first "
        "token); answered = seconds from the worker's launch to the answer, at the client",
        caption_justify="left",
    )
    for header in (
        "inference queue",
        "rounds",
        "first TTFT",
        "steady TTFT",
        "first/steady",
        "cached tokens",
        "answered after s",
    ):
        table.add_column(header, justify="left" if header == "inference queue" else "right")
    for row in report["rows"]:
        table.add_row(
            "gated (after warm)" if row["gated"] else "ungated (from start)",
            str(row["rounds"]),
            f"{row['first_ttft_ms']:,.1f}",
            f"{row['steady_ttft_ms']:,.1f}",
            f"{row['first_over_steady']:.2f}",
            f"{row['first_cached_tokens']:.0f}",
            f"{row['first_answered_s']:.1f}",
        )
    console.print(table)
    console.print(
        f"gated first/steady target ≤ {FIRST_REQUEST_TARGET}: {'met' if report['target']['met'] else 'NOT met'}"
    )
    _write(report, json_path or settings.home / "bench" / "first-request.json", console)


def _counts(value: str) -> list[int]:
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of worker counts") from None
    if not counts or min(counts) < 1 or max(counts) > 16:
        raise typer.BadParameter("worker counts must be between 1 and 16")
    return counts


@app.command()
def fanout(
    workers: str = typer.Option("1,2,4", help="Worker counts to measure, comma-separated."),
    rounds: int = typer.Option(3, min=1, max=20, help="Fresh fleets per count; figures are medians."),
    template: list[str] = typer.Option(None, "--template", "-t", help="Templates to warm (default: all)."),
    timeout: float = typer.Option(300.0, min=10.0, help="Seconds to wait for workers and jobs."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/fanout.json."),
) -> None:
    """Warm N fresh workers with one `preheat warm` and compare the total time with the
    slowest single worker's own time (what a perfect fan-out would take)."""
    from rich.table import Table

    from preheat.cli import render
    from preheat.cli.fleetbench import fanout_round, median_fanout

    console = render.console()
    counts = _counts(workers)
    settings, catalog = _bench_setup(console, "bench fanout starts its own workers")
    for name in template or []:
        catalog.template(name)  # unknown names fail before any worker starts
    rows = []
    for count in counts:
        measured = []
        for i in range(rounds):
            measured.append(fanout_round(count, template or None, settings.home / "bench" / "logs", timeout))
            console.print(
                f"  {count} worker(s), round {i + 1}: {measured[-1].total_s:.2f} s in all, slowest "
                f"worker {measured[-1].slowest_worker_s:.2f} s"
            )
        rows.append(median_fanout(measured))
    met = all(row.total_over_slowest <= FANOUT_TARGET for row in rows)
    report = {
        "benchmark": "fanout",
        "host": _host(),
        "templates": template or list(catalog.templates),
        "rounds": rounds,
        "rows": [{**vars(row), "total_over_slowest": row.total_over_slowest} for row in rows],
        "target": {"total_over_slowest": f"<= {FANOUT_TARGET}", "met": met},
    }
    table = Table(
        title="one warmup to N workers: total vs the slowest single worker",
        title_justify="left",
        caption=f"median of {rounds} round(s); total = dispatch to every job final in history; slowest = "
        "the longest any one worker spent on its jobs",
        caption_justify="left",
    )
    for header in ("workers", "total s", "slowest worker s", "total/slowest", "jobs"):
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(
            str(row.workers),
            f"{row.total_s:.2f}",
            f"{row.slowest_worker_s:.2f}",
            f"{row.total_over_slowest:.2f}",
            ", ".join(f"{n} {s}" for s, n in sorted(row.statuses.items())),
        )
    console.print(table)
    console.print(f"total/slowest target ≤ {FANOUT_TARGET}: {'met' if met else 'NOT met'}")
    _write(report, json_path or settings.home / "bench" / "fanout.json", console)


@app.command()
def beat(
    slots: int = typer.Option(12, min=2, max=16, help="Slots to fire, one per schedule."),
    spacing: int = typer.Option(3, min=1, max=10, help="Seconds between fire times (all within a minute)."),
    kill_after: int = typer.Option(3, min=1, help="Kill the leading beat after this many slots fired."),
    template: str = typer.Option(None, help="Template each slot warms (default: the catalog's first)."),
    timeout: float = typer.Option(120.0, min=10.0, help="Seconds to wait for processes and slots."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/beat.json."),
) -> None:
    """Scheduled warmups fired by two real beats, the leader killed midway: how late each slot
    fired, before the kill, during the takeover and after, and how long the takeover took."""
    from rich.table import Table

    from preheat.cli import render
    from preheat.cli.beatbench import phases, run

    console = render.console()
    if slots * spacing >= 55:
        raise typer.BadParameter("slots x spacing must stay under 55 s (each schedule fires once a minute)")
    if kill_after >= slots:
        raise typer.BadParameter("--kill-after must leave slots for the standby")
    settings, catalog = _bench_setup(console, "bench beat starts its own worker and beats")
    template = template or next(iter(catalog.templates))
    catalog.template(template)
    lease_s = settings.beat_lease_s
    timings, killed_at, took_over, runs = run(
        slots, spacing, kill_after, lease_s, template, settings.home / "bench" / "logs", timeout
    )
    takeover_s = (took_over - killed_at).total_seconds() if took_over else None
    rows = phases(timings, killed_at, took_over)
    report = {
        "benchmark": "beat",
        "host": _host(),
        "slots": slots,
        "spacing_s": spacing,
        "tick_s": settings.beat_tick_s,
        "lease_s": lease_s,
        "takeover_s": takeover_s,
        "runs": runs,
        "phases": [vars(row) for row in rows],
        "slots_detail": [
            {"fire_at": t.fire_at.isoformat(), "late_ms": t.late_ms, "status": t.status, "fired_by": t.fired_by}
            for t in timings
        ],
    }
    table = Table(
        title="scheduled warmups: fired how late, leader killed midway",
        title_justify="left",
        caption=f"late = run recorded − fire time; tick {settings.beat_tick_s:g} s, lease {lease_s:g} s; "
        f"takeover {'-' if takeover_s is None else f'{takeover_s:.1f} s'} after the kill",
        caption_justify="left",
    )
    for header in ("phase", "slots", "sent", "late p50 ms", "late max ms"):
        table.add_column(header, justify="left" if header == "phase" else "right")
    for row in rows:
        table.add_row(
            row.name,
            str(row.slots),
            str(row.sent),
            "-" if row.late_p50_ms is None else f"{row.late_p50_ms:,.0f}",
            "-" if row.late_max_ms is None else f"{row.late_max_ms:,.0f}",
        )
    console.print(table)
    console.print(
        f"{sum(r.sent for r in rows)} of {slots} slots sent, {runs} run(s) recorded; takeover "
        + (
            f"{takeover_s:.1f} s (bound: lease {lease_s:g} s + tick {settings.beat_tick_s:g} s)"
            if takeover_s is not None
            else "not seen"
        )
    )
    _write(report, json_path or settings.home / "bench" / "beat.json", console)


CONNECT_TARGET = 1.2  # first request through a pre-opened pool / steady state


@app.command()
def connect(
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
    from rich.table import Table

    from preheat.catalog import load_catalog
    from preheat.cli import render
    from preheat.cli.connectbench import measure, run
    from preheat.cli.dev import build_missing_models
    from preheat.settings import get_settings

    console = render.console()
    settings = get_settings()
    catalog = load_catalog(settings.catalog)
    spec = catalog.endpoint(endpoint) if endpoint else None
    name = template or (spec.templates[0] if spec and spec.templates else next(iter(catalog.templates), None))
    if name is None:
        raise ConfigError(f"catalog {settings.catalog} has no template to request")
    catalog.template(name)
    target = f"endpoint {endpoint} ({spec.base_url})" if spec else "preheat serve over TLS on loopback"
    console.print(f"first request through a connection pool · {target}, template {name!r}, {rounds} rounds …")
    if spec:
        report = measure(
            spec.model_copy(update={"http2": http2 or spec.http2}),
            catalog,
            name,
            spec.model or catalog.template(name).model,
            rounds,
        )
    else:
        build_missing_models(catalog, console)
        report = run(catalog, name, rounds, http2, settings.home / "bench", timeout)
    table = Table(
        title="TTFT of a streamed request over TLS: fresh client vs pre-opened pool vs steady state",
        title_justify="left",
        caption=f"ms, client-side (request → first token), median of {rounds} "
        "interleaved rounds; pre-opened paid its connection ahead",
        caption_justify="left",
    )
    for header in ("way", "TTFT ms", "× steady"):
        table.add_column(header, justify="left" if header == "way" else "right")
    table.add_row(
        "fresh client (TCP + TLS on the request)", f"{report.fresh_ms:,.2f}", f"{report.fresh_over_steady:.2f}"
    )
    table.add_row(
        "pre-opened pool, first request", f"{report.preopened_ms:,.2f}", f"{report.preopened_over_steady:.2f}"
    )
    table.add_row("steady state (a connection that served before)", f"{report.steady_ms:,.2f}", "1.00")
    console.print(table)
    met = report.preopened_over_steady <= CONNECT_TARGET
    console.print(
        f"opening the pool's connection ahead took {report.establish_ms:,.2f} ms; pre-opened / steady "
        f"target ≤ {CONNECT_TARGET}: {'met' if met else 'NOT met'}"
    )
    _write(
        {
            "benchmark": "connect",
            "template": name,
            "measured_against": target,
            "host": _host(),
            "http2_offered": http2,
            "rounds": rounds,
            "fresh_ms": report.fresh_ms,
            "preopened_ms": report.preopened_ms,
            "steady_ms": report.steady_ms,
            "establish_ms": report.establish_ms,
            "fresh_over_steady": report.fresh_over_steady,
            "preopened_over_steady": report.preopened_over_steady,
            "target": {"preopened_over_steady": f"<= {CONNECT_TARGET}", "met": met},
        },
        json_path or settings.home / "bench" / "connect.json",
        console,
    )


@app.command()
def outbox(
    writes: int = typer.Option(500, min=10, max=100_000, help="History writes per way."),
    json_path: Path = typer.Option(None, "--json", help="Default: HOME/bench/outbox.json."),
) -> None:
    """What the history outbox costs: a job's finish written directly, the same write while the
    database is away (kept on disk), and the replay once it is back, on the configured database."""
    from rich.table import Table

    from preheat import migrate
    from preheat.cli import render
    from preheat.cli.outboxbench import run
    from preheat.settings import get_settings

    console, settings = render.console(), get_settings()
    if settings.database.startswith("sqlite"):
        migrate.upgrade(settings.database)
    ways, left = run(writes, settings.home / "bench" / "outbox")
    report = {
        "benchmark": "outbox",
        "host": _host(),
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
    _write(report, json_path or settings.home / "bench" / "outbox.json", console)
