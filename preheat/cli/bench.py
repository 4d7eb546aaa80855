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
        ModelSource(name, catalog.model_path(name), spec.dtype, spec.revision))
    wanted = _lengths(lengths)
    if resident.max_context and wanted[-1] + 64 > resident.max_context:
        raise ConfigError(f"a {wanted[-1]}-token system prompt leaves no room in {name}'s context of "
                          f"{resident.max_context}")
    source_text = "".join(_corpus(40 * wanted[-1]))
    console.print(f"measuring {name} on {resident.placement.describe()} (loaded in {load_ms:,.0f} ms): "
                  f"{len(wanted)} lengths × {repeats} rounds …")
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
        f"saved_at_{longest.system_tokens}_pct": {"target": f">= {SAVED_TARGET_PCT}", "measured": longest.saved_pct,
                                                   "met": longest.saved_pct >= SAVED_TARGET_PCT},
        "reuse_overhead_pct": {"target": f"<= {OVERHEAD_TARGET_PCT}", "measured": worst_overhead,
                               "met": worst_overhead <= OVERHEAD_TARGET_PCT},
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
        "model": {"name": name, "path": resident.path, "architecture": config.model_type,
                  "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                  "parameters": sum(p.numel() for p in resident.model.parameters())},
        "device": resident.placement.describe(),
        "host": {"machine": platform.machine(), "torch": torch.__version__, "transformers": transformers.__version__,
                 "threads": torch.get_num_threads()},
        "repeats": repeats,
        "user_input": user_input,
        "rows": [row.as_dict() for row in rows],
        "targets": targets,
        "verdicts": verdicts,
    }
