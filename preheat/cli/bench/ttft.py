"""`preheat bench ttft`: time to first token cold vs warm vs bare, per system prompt length."""

from __future__ import annotations

import datetime as dt
import platform
from pathlib import Path

from preheat.cli.bench import tables
from preheat.cli.bench.common import prepare, token_counts, write_report
from preheat.core.errors import ConfigError

SAVED_TARGET_PCT = 95.0  # at the longest system prompt
OVERHEAD_TARGET_PCT = 2.0  # reuse (lookup + id check + clone) against the warm TTFT
RESTORE_TARGET = 0.1  # restoring a stored prefix against computing it, at the longest length
TURN_ONE_TOKENS = 512  # the first turn's user message in the turn-two row


def main(model: str, lengths: str, repeats: int, user_input: str, json_path: Path) -> None:
    """The command (its options are declared in preheat.cli.bench): measure, print, write JSON."""
    from preheat.cli import render
    from preheat.cli.bench.measure import measure_ttft, measure_turn_two, system_prompt_text
    from preheat.cli.devmodel import _corpus
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    def known_model(settings, catalog) -> None:
        if (model or next(iter(catalog.models), None)) is None:
            raise ConfigError(f"catalog {settings.catalog} names no model to measure")
        catalog.model(model or next(iter(catalog.models)))  # an unknown name is one clear error

    console = render.console()
    settings, catalog = prepare(console, database=False, validate=known_model)
    name = model or next(iter(catalog.models))
    spec = catalog.model(name)
    resident, load_ms = ResidentModels(settings.device).ensure(
        ModelSource(name, catalog.model_path(name), spec.dtype, spec.revision)
    )
    wanted = token_counts(lengths)
    if resident.max_context and wanted[-1] + 64 > resident.max_context:
        raise ConfigError(
            f"a {wanted[-1]}-token system prompt leaves no room in {name}'s context of {resident.max_context}"
        )
    source_text = "".join(_corpus(40 * wanted[-1]))
    console.print(
        f"measuring {name} on {resident.placement.describe()} (loaded in {load_ms:,.0f} ms): "
        f"{len(wanted)} lengths × {repeats} rounds …"
    )
    prompts = [system_prompt_text(resident, n, source_text) for n in wanted]
    rows = [measure_ttft(resident, prompt, repeats, user_input, n) for prompt, n in zip(prompts, wanted, strict=True)]
    # Turn one pastes a 512-token excerpt (from the end of the source: not the system prompt).
    pasted = system_prompt_text(resident, TURN_ONE_TOKENS, source_text[len(source_text) // 2 :])
    turn_two = measure_turn_two(resident, prompts[0], repeats, pasted)

    report = _report(name, resident, repeats, user_input, rows)
    report["turn_two"] = turn_two.as_dict()
    report["verdicts"].append(
        f"turn two ({turn_two.turn_two_tokens} tokens, turn one {turn_two.turn_one_tokens}) with turn one "
        f"cached: {turn_two.ttft_with_turn_one_ms:.1f} ms "
        f"({turn_two.cached_with_turn_one} cached) against {turn_two.ttft_prefix_only_ms:.1f} ms with the system "
        f"prompt alone ({turn_two.cached_prefix_only} cached): {turn_two.speedup:.2f}x"
    )
    console.print(tables.ttft_table(report))
    console.print(tables.turn_two_table(report))
    for line in report["verdicts"]:
        console.print(line, highlight=False)
    write_report(report, json_path or settings.home / "bench" / "ttft.json", console)


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
        f"restore_over_prefill_at_{longest.system_tokens}": {
            "target": f"<= {RESTORE_TARGET}",
            "measured": longest.restore_over_prefill,
            "met": longest.restore_over_prefill <= RESTORE_TARGET,
        },
    }
    verdicts = [
        f"saved at {longest.system_tokens} tokens: {longest.saved_pct:.1f}% (target ≥ {SAVED_TARGET_PCT:.0f}%: "
        f"{'met' if targets[f'saved_at_{longest.system_tokens}_pct']['met'] else 'NOT met'})",
        f"reuse overhead: at most {worst_overhead:.2f}% of warm TTFT (target ≤ {OVERHEAD_TARGET_PCT:.0f}%: "
        f"{'met' if targets['reuse_overhead_pct']['met'] else 'NOT met'})",
        f"warm / bare at {longest.system_tokens} tokens: {longest.warm_over_bare:.2f} (1.0 = the system prompt "
        f"costs nothing)",
        f"restore / prefill at {longest.system_tokens} tokens: {longest.restore_over_prefill:.3f} (target ≤ "
        f"{RESTORE_TARGET:g}: {'met' if longest.restore_over_prefill <= RESTORE_TARGET else 'NOT met'})",
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
