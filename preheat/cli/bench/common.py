"""What every benchmark shares: its set-up, its host description, its JSON report, the
processes it starts (their environment and names), the dev models it measures on, and the
parsing of list options."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import typer


def prepare(console, *, exclusive: str | None = None, database: bool = True, models: bool = True, validate=None):
    """Settings and catalog; `validate(settings, catalog)` first (bad names fail before any
    work); the dev models built if missing (`models`); the history database migrated
    (`database`); and with `exclusive` (why the bench must be alone), no live worker taking
    part. Returns (settings, catalog)."""
    from preheat.cli.dev import build_missing_models
    from preheat.core.catalog import load_catalog
    from preheat.core.settings import get_settings
    from preheat.history import migrate

    settings = get_settings()
    catalog = load_catalog(settings.catalog)
    if validate is not None:
        validate(settings, catalog)
    if models:
        build_missing_models(catalog, console)
    settings.home.mkdir(parents=True, exist_ok=True)
    if database:
        migrate.upgrade(settings.database)
    if exclusive:
        ensure_no_live_workers(exclusive)
    return settings, catalog


def ensure_no_live_workers(why: str) -> None:
    """A benchmark's requests must reach only the workers it started."""
    from preheat.cli.lazy import get_settings
    from preheat.core.errors import ConfigError
    from preheat.fleet import registry
    from preheat.history.db import session_scope

    with session_scope() as session:
        live = [w.nodename for w in registry.live_workers(session, get_settings().worker_dead_after_s)]
    if live:
        raise ConfigError(
            f"{why}, but live worker(s) would take part: {', '.join(live)}; stop them or point "
            f"PREHEAT_HOME / the broker at a separate stack"
        )


def worker_env(**overrides: str) -> dict[str, str]:
    """The environment of a worker a benchmark starts: a free health port each, as several
    workers share this machine."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PREHEAT_HEALTH_PORT": "0", **overrides}


def worker_name(kind: str) -> str:
    """A worker name of its own per benchmark process."""
    return f"bench-{kind}-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"


MODELS = ("real", "135m", "tiny")


def dev_model(folder: Path, shape: str, console) -> Path:
    """The model a benchmark measures: `real`, SmolLM2-135M-Instruct (converted once per
    machine, preheat.cli.realmodel); or a random one of `shape` (tiny, or SmolLM-135M's: 30
    layers of 576, 9 heads over 3 KV heads, 49,152 embedding rows) in `folder`, built there
    if it is not yet. The path is absolute: the catalogs that name it resolve relative paths
    against their own folder."""
    from preheat.cli.devmodel import ModelShape, make_model
    from preheat.core.errors import ConfigError

    if shape not in MODELS:
        raise ConfigError(f"--model must be one of {', '.join(MODELS)}, got {shape!r}")
    if shape == "real":
        from preheat.cli.realmodel import machine_copy

        console.print("SmolLM2-135M-Instruct (converted once per machine) …")
        return machine_copy()
    folder = folder.resolve()
    if (folder / "config.json").exists():
        return folder
    console.print(f"building the {shape} dev model in {folder} …")
    dims = ModelShape(576, 1536, 30, 9, 3, 2048, padded_vocab=49152) if shape == "135m" else ModelShape()
    return make_model(folder, shape=dims)


@contextlib.contextmanager
def database_url(url: str) -> Iterator[None]:
    """This process's history database is `url` inside the block (settings and engine
    reloaded), the configured one again after it."""
    with settings_from(PREHEAT_DATABASE_URL=url):
        yield


@contextlib.contextmanager
def settings_from(**variables: str) -> Iterator[None]:
    """This process's settings read with `variables` set inside the block (settings and the
    database engine reloaded), as configured again after it."""
    from preheat.core import settings
    from preheat.history.db import reset_connections

    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    settings.get_settings.cache_clear()
    reset_connections()
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        settings.get_settings.cache_clear()
        reset_connections()


def write_report(report: dict, path: Path, console) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {path}")


def host() -> dict:
    from preheat.core.settings import get_settings
    from preheat.workers.engine.device import cpu_flags

    settings = get_settings()
    return {
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        # The vector instructions decide the fast precision and kernels: figures from hosts
        # that differ here do not compare (AVX2 only vs AVX-512 with bfloat16).
        "cpu_flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"}),
        "cpus": os.cpu_count(),
        "stack": "embedded (filesystem broker, SQLite)" if settings.is_embedded else "broker + database from env",
    }


def _cpu_model() -> str:
    try:
        found = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:  # not Linux
        found = None
    return found[1].strip() if found else platform.processor()


def token_counts(value: str) -> list[int]:
    try:
        lengths = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of token counts") from None
    if not lengths or lengths[0] < 2:
        raise typer.BadParameter("every length must be at least 2 tokens")
    return lengths


def worker_counts(value: str) -> list[int]:
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of worker counts") from None
    if not counts or min(counts) < 1 or max(counts) > 16:
        raise typer.BadParameter("worker counts must be between 1 and 16")
    return counts
