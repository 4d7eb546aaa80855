"""`preheat bench lora`: LoRA adapters warmed ahead against cold, and batched against the base.

On one worker runtime (the production path, in this process), with adapters made here by
PEFT (rank 16 on q/k/v/o and the MLP, random weights, as `preheat dev make-adapter` writes):

- **First request.** The same chat request (a system prompt and a user turn) as the first to
  the base (its template warm), to an adapter warmed ahead (its template pre-filled under it,
  pinned), and to a cold adapter (never read: its first user pays the read, the pre-fill of
  the whole prompt under it). TTFT of each, medians over fresh adapters.
- **Load.** Reading and proving one adapter (`read_adapter`), median.
- **Many users.** 16 closed-loop users, each sending `--requests-per-user` requests, all on the
  base, then spread round-robin over 1, 4 and 16 adapters (each resident, its template's prefix
  cached by an untimed first request): tokens/s and TTFT p50 of each. `--rounds` rounds, each
  running the base and every spread in turn; a spread's ratio is over its own round's base.
  The prefix cache pins every template's prefix (the base's and each adapter's): its entries
  are `PREHEAT_KV_CACHE_MAX_ENTRIES`, raised where their pinned share holds fewer, as an
  operator serving that many templates sets it. With the default 10 entries (5 pinned), 16
  adapters' templates evict one another, and the spreads would measure their eager pre-fills
  again, not the batching.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
from pathlib import Path

from rich.table import Table

from preheat.cli.bench.common import dev_model, host, write_report

SYSTEM = "You are a support agent for an online shop. Answer in one short sentence, politely."
USERS = 16
SPREADS = (1, 4, 16)
TARGET_WARM_OVER_BASE = 1.2
TARGET_TOKENS_OVER_BASE = 0.8


def _catalog(folder: Path, model_dir: Path, adapters: dict[str, Path]) -> Path:
    lines = [f'[models.m]\npath = "{model_dir}"\nmax_adapters = {len(adapters)}\n[models.m.adapters]\n']
    lines += [f'{name} = "{path}"\n' for name, path in adapters.items()]
    lines.append(f'\n[templates.base]\nmodel = "m"\nsystem_prompt = "{SYSTEM}"\n')
    lines += [
        f'\n[templates.{name}]\nmodel = "m"\nadapter = "{name}"\nsystem_prompt = "{SYSTEM}"\n' for name in adapters
    ]
    path = folder / "lora.toml"
    path.write_text("".join(lines))
    return path


def _ttft(runtime, model: str, text: str, max_tokens: int = 1) -> float:
    from preheat.api.sampling import SamplingParams
    from preheat.workers.engine.chat import conversation

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return runtime.generate_chat(model, conversation(SYSTEM, text), sampling, remember=False).collect().ttft_ms


def _many(runtime, models: list[str], per_user: int, max_tokens: int) -> dict:
    from preheat.api.sampling import SamplingParams
    from preheat.workers.engine.chat import conversation

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ttfts, tokens, errors = [], [0], []
    lock = threading.Lock()

    def user(index: int) -> None:
        model = models[index % len(models)]
        for turn in range(per_user):
            try:
                done = runtime.generate_chat(
                    model, conversation(SYSTEM, f"Order {index}-{turn}: where is it?"), sampling, remember=False
                ).collect()
            except Exception as exc:  # counted, not fatal: the row says how many
                errors.append(str(exc))
                continue
            with lock:
                ttfts.append(done.ttft_ms)
                tokens[0] += len(done.token_ids)

    started = time.perf_counter()
    threads = [threading.Thread(target=user, args=(i,)) for i in range(USERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    return {
        "tokens_per_s": round(tokens[0] / seconds, 1),
        "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
        "requests": len(ttfts),
        "errors": len(errors),
    }


def _median_run(runs: list[dict], base: list[dict]) -> dict:
    """One serving's rounds as one row: medians, and its tokens/s over the base's of the same
    round (a shared host drifts between rounds more than within one), median of the rounds."""
    ratios = [run["tokens_per_s"] / own["tokens_per_s"] for run, own in zip(runs, base, strict=True)]
    ttfts = [run["ttft_p50_ms"] for run in runs if run["ttft_p50_ms"] is not None]
    return {
        "tokens_per_s": round(statistics.median(run["tokens_per_s"] for run in runs), 1),
        "over_base": round(statistics.median(ratios), 2),
        "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
        "requests": sum(run["requests"] for run in runs),
        "errors": sum(run["errors"] for run in runs),
        "rounds": runs,
    }


def main(*, shape: str, adapters: int, rounds: int, per_user: int, max_tokens: int, json_path: Path | None) -> None:
    from preheat.cli import render
    from preheat.cli.devadapter import make_adapter
    from preheat.core.catalog import load_catalog
    from preheat.core.settings import get_settings
    from preheat.workers.engine.kvcache import CacheBudget
    from preheat.workers.engine.lora import read_adapter
    from preheat.workers.runtime import RuntimeConfig, WorkerRuntime

    console = render.console()
    settings = get_settings()
    folder = (settings.home / "bench" / "lora").resolve()
    model_dir = dev_model(folder / "models" / shape, shape, console)
    count = max(adapters, max(SPREADS) + rounds)
    console.print(f"{count} rank-16 adapters of the {shape} model (made once, by PEFT) …")
    made = {  # per model: an adapter is proven against its base, and refused by another
        f"t{i:02d}": make_adapter(model_dir, folder / "adapters" / shape / f"t{i:02d}", seed=i) for i in range(count)
    }
    catalog = load_catalog(_catalog(folder, model_dir, made))
    config = RuntimeConfig.from_settings(settings)
    budget = config.cache_budget
    templates = len(made) + 1  # each adapter's and the base's, pinned
    entries = max(budget.max_entries, math.ceil(templates / budget.pinned_share) if budget.pinned_share else templates)
    config = dataclasses.replace(config, cache_budget=CacheBudget(entries, budget.max_bytes, budget.pinned_share))
    runtime = WorkerRuntime(catalog, config)
    try:
        runtime.load_models()
        runtime.compile_steps("m")  # as a worker does at start: its steps, with adapters, compiled
        for template in ("base", "t00"):
            runtime.templates.prefill(template)  # the base's template, and one adapter's, warm
        resident = runtime.resident_models.get("m")
        loads = [read_adapter(n, "m", made[n], resident.model, max_rank=64).load_ms for n in list(made)[:rounds]]
        _ttft(runtime, "m", "warming the process up")
        first = {"base": [], "warmed ahead": [], "cold": []}
        cold_names = list(made)[-rounds:]
        for round_ in range(rounds):
            text = f"Hello, where is my parcel? (round {round_})"
            first["base"].append(_ttft(runtime, "m", text))
            first["warmed ahead"].append(_ttft(runtime, "t00", text))
            first["cold"].append(_ttft(runtime, cold_names[round_], text))
        first_ms = {way: round(statistics.median(ms), 1) for way, ms in first.items()}
        for name in list(made)[: max(SPREADS)]:  # resident, its template's prefix cached by a first
            runtime.adapters.weights(name)  # request (not timed): the spreads measure batching,
            _ttft(runtime, name, "warming the adapter's template")  # not reads or pre-fills
        spreads = {"base": ["m"], **{f"{n} adapter(s)": list(made)[:n] for n in SPREADS}}
        runs: dict[str, list[dict]] = {serving: [] for serving in spreads}
        for _ in range(rounds):  # interleaved: each round's spreads beside its own base
            for serving, names in spreads.items():
                runs[serving].append(_many(runtime, names, per_user, max_tokens))
        many = {serving: _median_run(done, runs["base"]) for serving, done in runs.items()}
    finally:
        runtime.close()
    steps = {
        name: m.runner.compile_report.source if m.runner.compile_report else "eager" for name, m in [("m", resident)]
    }
    warm_ratio = first_ms["warmed ahead"] / first_ms["base"]
    four = many["4 adapter(s)"]["over_base"]
    warm_met = "met" if warm_ratio <= TARGET_WARM_OVER_BASE else "NOT met"
    verdicts = [
        f"first request to an adapter warmed ahead: {first_ms['warmed ahead']} ms = {warm_ratio:.2f}× the base's "
        f"{first_ms['base']} ms (target ≤ {TARGET_WARM_OVER_BASE}×: {warm_met}); "
        f"a cold adapter's: {first_ms['cold']} ms",
        f"16 users over 4 adapters: {four:.2f}× the tokens/s of 16 users on the base "
        f"(target ≥ {TARGET_TOKENS_OVER_BASE}×: {'met' if four >= TARGET_TOKENS_OVER_BASE else 'NOT met'})",
    ]
    report = {
        "host": host(),
        "model": shape,
        "steps": steps["m"],
        "prefix_cache_entries": entries,
        "adapter_load_ms": round(statistics.median(loads), 1),
        "first_request_ttft_ms": first_ms,
        "many_users": many,
        "verdicts": verdicts,
    }
    table = Table(
        title=f"LoRA adapters · {shape}, {USERS} users, max_tokens {max_tokens}, steps {steps['m']}, "
        f"prefix cache {entries} entries",
        caption=f"medians of {rounds} interleaved rounds; × base: over the base's tokens/s of the same round",
    )
    for header in ("serving", "tokens/s", "× base", "TTFT p50 ms", "requests", "errors"):
        table.add_column(header, justify="left" if header == "serving" else "right")
    for name, row in many.items():
        ttft = f"{row['ttft_p50_ms']:,.1f}" if row["ttft_p50_ms"] is not None else "—"
        table.add_row(
            name, f"{row['tokens_per_s']:,.1f}", f"{row['over_base']:.2f}", ttft, str(row["requests"]),
            str(row["errors"])
        )  # fmt: skip
    console.print(table)
    console.print(
        f"first request TTFT: base {first_ms['base']} ms · adapter warmed ahead {first_ms['warmed ahead']} ms · "
        f"cold adapter {first_ms['cold']} ms; one adapter read and proven in {report['adapter_load_ms']} ms"
    )
    for line in verdicts:
        console.print(line, highlight=False)
    write_report(report, json_path or folder / "lora.json", console)
