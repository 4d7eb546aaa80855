"""What every benchmark shares: its set-up, its host description, its JSON report, and
the parsing of list options."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import typer


def prepare(console, *, exclusive: str | None = None, database: bool = True, models: bool = True, validate=None):
    """Settings and catalog; `validate(settings, catalog)` first (bad names fail before any
    work); the dev models built if missing (`models`); the history database migrated
    (`database`); and with `exclusive` (why the bench must be alone), no live worker taking
    part. Returns (settings, catalog)."""
    from preheat import migrate
    from preheat.catalog import load_catalog
    from preheat.cli.dev import build_missing_models
    from preheat.settings import get_settings

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
        from preheat.cli.bench.fleet import ensure_no_live_workers

        ensure_no_live_workers(exclusive)
    return settings, catalog


def write_report(report: dict, path: Path, console) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {path}")


def host() -> dict:
    from preheat.settings import get_settings

    settings = get_settings()
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "stack": "embedded (filesystem broker, SQLite)" if settings.is_embedded else "broker + database from env",
    }


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
