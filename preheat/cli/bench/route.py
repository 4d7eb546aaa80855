"""`preheat bench route`: requests routed to the worker that holds their prefix, against the
model's shared queue alone, side by side on one fleet in one run.

It starts N workers on the configured stack with a catalog of its own: one dev model and
`factor` × as many templates as one worker can pin (PREHEAT_KV_CACHE_* set so that a worker
pins `--pinned`), so the fleet's plan spreads them (preheat.fleet.placement). Then, for each mode
(`routed`: preheat.fleet.routing as shipped; `shared`: PREHEAT_ROUTING off, every request to the
shared queue):

- **conversations**: C users at once, each a conversation of T turns with a system prompt of
  its own; turns 2..T are what affinity is for. Measured: the share of their prompt tokens
  that came from a cache, and their TTFT (the worker's, from taking the request to its
  first token).
- **templates**: R requests spread over the catalog's templates, sent by 2 × N users at once.
  Measured: the share that started from a pinned prefix (answered by a worker that holds the
  template pinned), and each worker's queue against its bound, sampled every 0.25 s: a
  sample where one worker holds more than its bound while another sits idle is counted.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from preheat.cli.bench.common import dev_model, host, prepare, settings_from, worker_env, worker_name, write_report

TARGETS = {"cached_share": 0.90, "ttft_p50_ratio": 0.4, "from_pinned": 0.95}
QUESTIONS = (
    "Where is my parcel right now?",
    "When will it reach the depot?",
    "Can I collect it there instead?",
    "Who do I call if it is late?",
    "Can you send me the tracking link?",
    "Thanks, is there anything else I should know?",
)
SAMPLE_S = 0.25


@dataclass
class Asked:
    """One request as the bench saw it."""

    phase: str  # conversation | template
    turn: int  # the conversation's turn (1..T); 0 for a template request
    template: str | None
    worker: str
    route: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    client_ms: float
    from_pinned: bool = False


@dataclass
class QueueWatch:
    """Each worker's requests (own queue + engine) against its bound, sampled."""

    bound: int
    samples: int = 0
    over_bound_while_idle: int = 0
    most: dict[str, int] = field(default_factory=dict)


def _prompt(index: int, words: int, kind: str) -> str:
    rules = " ".join(f"Rule {i}: for {kind} {index}, check record {index * 7 + i} first." for i in range(words // 9))
    return f"You are assistant {index} of Acme Parcel for {kind} questions. {rules}"


def bench_catalog(folder: Path, model_dir: Path, templates: int, words: int) -> Path:
    lines = [f'[models.bench]\npath = "{model_dir}"\n']
    for i in range(templates):
        lines.append(
            f'[templates.t{i:02d}]\nmodel = "bench"\nsystem_prompt = "{_prompt(i, words, "template")}"\n'
            'probe = "Where is my parcel?"\n'
        )
    path = folder / "route.toml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def _answered(call, kwargs: dict, began: float, phase: str, turn: int, holders: dict) -> tuple[Asked, str]:
    """What one request measured, and its answer's text."""
    answer = call.get(600)
    usage = answer["usage"]
    template = kwargs.get("template")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return Asked(
        phase,
        turn,
        template,
        answer["worker"],
        " → ".join(route.reason for route in call.routes),
        usage["prompt_tokens"],
        cached,
        answer["preheat"]["ttft_ms"],
        (time.perf_counter() - began) * 1000,
        from_pinned=template is not None and answer["worker"] in holders.get(template, ()) and cached > 0,
    ), answer["choices"][0]["message"]["content"]


def _threads(targets) -> None:
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def conversations(router, mode: str, users: int, turns: int, words: int, max_tokens: int) -> list[Asked]:
    asked, lock = [], threading.Lock()

    def user(index: int) -> None:
        messages = [{"role": "system", "content": _prompt(index, words, f"{mode} customer")}]
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": QUESTIONS[(index + turn) % len(QUESTIONS)]})
            kwargs = {"model": "bench", "messages": list(messages), "temperature": 0, "max_tokens": max_tokens}
            began = time.perf_counter()
            result, text = _answered(router.send(kwargs), kwargs, began, "conversation", turn, {})
            with lock:
                asked.append(result)
            messages.append({"role": "assistant", "content": text})

    _threads([lambda i=i: user(i) for i in range(users)])
    return asked


def template_requests(router, templates: list[str], requests: int, users: int, holders: dict, max_tokens: int):
    asked, lock, order = [], threading.Lock(), list(range(requests))

    def user() -> None:
        while True:
            with lock:
                if not order:
                    return
                k = order.pop(0)
            template = templates[(k * 7) % len(templates)]
            question = QUESTIONS[k % len(QUESTIONS)] + f" (order {k})"
            kwargs = {"template": template, "messages": [{"role": "user", "content": question}]}
            kwargs.update(temperature=0, max_tokens=max_tokens)
            began = time.perf_counter()
            result, _ = _answered(router.send(kwargs), kwargs, began, "template", 0, holders)
            with lock:
                asked.append(result)

    _threads([user for _ in range(users)])
    return asked


def watch_queues(router, workers: list[str], bound: int, stop: threading.Event, watch: QueueWatch) -> None:
    while not stop.wait(SAMPLE_S):
        router._fleet = (0.0, {})  # every pulse now, not a second old
        fleet = router.fleet()
        load = {w: router.outstanding(w, fleet[w]) if w in fleet else 0 for w in workers}
        watch.samples += 1
        for worker, count in load.items():
            watch.most[worker] = max(watch.most.get(worker, 0), count)
        idle = [w for w, count in load.items() if count == 0]
        if idle and any(count > bound for w, count in load.items() if w not in idle):
            watch.over_bound_while_idle += 1


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(mode: str, asked: list[Asked], watch: QueueWatch) -> dict:
    later = [a for a in asked if a.phase == "conversation" and a.turn >= 2]
    first = [a for a in asked if a.phase == "conversation" and a.turn == 1]
    templated = [a for a in asked if a.phase == "template"]
    prompt = sum(a.prompt_tokens for a in later)
    return {
        "mode": mode,
        "turns_2_on": len(later),
        "cached_share": sum(a.cached_tokens for a in later) / prompt if prompt else None,
        "ttft_p50_ms": p50([a.ttft_ms for a in later]),
        "client_p50_ms": p50([a.client_ms for a in later]),
        "turn_1_ttft_p50_ms": p50([a.ttft_ms for a in first]),
        "template_requests": len(templated),
        "from_pinned": sum(a.from_pinned for a in templated) / len(templated) if templated else None,
        "template_ttft_p50_ms": p50([a.ttft_ms for a in templated]),
        "queue_samples": watch.samples,
        "over_bound_while_idle": watch.over_bound_while_idle,
        "most_outstanding": watch.most,
        "queue_bound": watch.bound,
    }


def _plan_settled(router, names: list[str], templates: list[str], pinned: int) -> dict | None:
    """Every worker serving, and every template held somewhere or every worker's pins used
    (a fleet with fewer pins than templates): the holders, or None yet."""
    from preheat.fleet.placement import holders_of

    router._fleet = (0.0, {})
    fleet = router.fleet()
    if not all(name in fleet and "bench" in fleet[name].serving for name in names):
        return None
    holders = holders_of({name: list(fleet[name].holds) for name in names})
    full = all(len(fleet[name].holds) >= pinned for name in names)
    return holders if set(templates) <= set(holders) or full else None


def main(
    workers: int,
    users: int,
    turns: int,
    pinned: int,
    factor: int,
    requests: int,
    shape: str,
    words: int,
    max_tokens: int,
    rows: int,
    timeout: float,
    json_path: Path | None,
) -> None:
    from rich.table import Table

    from preheat.celery.app import app
    from preheat.cli import render
    from preheat.core import processes
    from preheat.core.settings import get_settings
    from preheat.fleet.routing import Router

    console = render.console()
    settings, _ = prepare(console, exclusive="bench route starts its own workers", models=False)
    folder = settings.home / "bench" / "route"
    model_dir = dev_model(folder / "models" / shape, shape, console)
    names_of_templates = [f"t{i:02d}" for i in range(pinned * factor)]
    catalog = bench_catalog(folder, model_dir, len(names_of_templates), words)
    entries = max(16, 4 * pinned)
    fleet_env = {
        "PREHEAT_CATALOG": str(catalog),
        # `pinned` of `entries` may be pinned; the rest is the LRU part conversations use.
        "PREHEAT_KV_CACHE_MAX_ENTRIES": str(entries),
        "PREHEAT_KV_CACHE_PINNED_SHARE": str(pinned / entries),
        "PREHEAT_MAX_RUNNING_REQUESTS": str(rows),
        "PREHEAT_HEARTBEAT_INTERVAL_S": "1",
        # A store shared on one disk would restore each system prompt on every worker (remembered
        # turns stay in memory): off, so the shared queue is measured as separate hosts see it.
        "PREHEAT_PREFIX_STORE": "off",
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // workers)),
    }
    names = [worker_name(f"route{i}") for i in range(workers)]
    report_rows, asked_by_mode = [], {}
    with settings_from(PREHEAT_CATALOG=str(catalog)):
        fleet = [processes.start_worker(name, worker_env(**fleet_env), folder / "logs") for name in names]
        with processes.running(*fleet):
            probe = Router(app, get_settings())
            holders = processes.poll(
                lambda: _plan_settled(probe, names, names_of_templates, pinned),
                timeout,
                0.5,
                "the fleet's template plan",
            )
            console.print(
                f"{workers} workers up; plan: " + ", ".join(f"{t}@{len(h)}" for t, h in sorted(holders.items()))
            )
            for mode in ("routed", "shared"):
                router = Router(app, get_settings().model_copy(update={"routing": mode == "routed"}))
                bound = rows + router.settings.route_max_waiting
                watch, stop = QueueWatch(bound), threading.Event()
                watcher = threading.Thread(target=watch_queues, args=(router, names, bound, stop, watch), daemon=True)
                watcher.start()
                asked = conversations(router, mode, users, turns, words, max_tokens)
                asked += template_requests(router, names_of_templates, requests, 2 * workers, holders, max_tokens)
                stop.set()
                watcher.join()
                asked_by_mode[mode] = asked
                report_rows.append(summarise(mode, asked, watch))
                console.print(f"  {mode}: {len(asked)} requests answered")
    routed, shared = report_rows
    ratio = routed["ttft_p50_ms"] / shared["ttft_p50_ms"] if shared["ttft_p50_ms"] else None
    met = {
        "cached_share": routed["cached_share"] is not None and routed["cached_share"] >= TARGETS["cached_share"],
        "ttft_p50_ratio": ratio is not None and ratio <= TARGETS["ttft_p50_ratio"],
        "from_pinned": routed["from_pinned"] is not None and routed["from_pinned"] >= TARGETS["from_pinned"],
        "no_queue_over_bound_while_idle": routed["over_bound_while_idle"] == 0,
    }
    report = {
        "benchmark": "route",
        "host": host(),
        "shape": shape,
        "workers": workers,
        "conversations": {"users": users, "turns": turns, "system_prompt_words": words},
        "templates": {"count": len(names_of_templates), "pinned_per_worker": pinned, "factor": factor},
        "template_requests": requests,
        "rows": report_rows,
        "ttft_p50_routed_over_shared": ratio,
        "targets": {**{name: value for name, value in TARGETS.items()}, "met": met},
        "requests": {mode: [asdict(a) for a in asked] for mode, asked in asked_by_mode.items()},
    }
    console.print(_table(report_rows, workers, len(names_of_templates), pinned, Table))
    console.print(
        f"turns 2-{turns}: {_pct(routed['cached_share'])} of prompt tokens from a cache routed (target ≥ 90 %), "
        f"{_pct(shared['cached_share'])} on the shared queue; TTFT p50 routed/shared "
        f"{'-' if ratio is None else f'{ratio:.2f}'} (target ≤ 0.4); templates from a pinned prefix "
        f"{_pct(routed['from_pinned'])} routed (target ≥ 95 %), {_pct(shared['from_pinned'])} shared; "
        f"queue over its bound while another idled: {routed['over_bound_while_idle']} of "
        f"{routed['queue_samples']} samples"
    )
    console.print("targets: " + ", ".join(f"{name} {'met' if ok else 'NOT met'}" for name, ok in met.items()))
    write_report(report, json_path or settings.home / "bench" / "route.json", console)


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f} %"


def _table(rows: list[dict], workers: int, templates: int, pinned: int, Table):
    from preheat.cli.render import ms_cell

    table = Table(
        title=f"routed vs the shared queue: {workers} workers, {templates} templates ({pinned} pinnable per worker)",
        title_justify="left",
        caption="turns 2+: a conversation's later turns; TTFT: the worker's, taking the request to its first "
        "token; from pinned: answered by a worker holding the template pinned; queue: requests on a worker "
        "(its own queue + engine) sampled every 0.25 s",
        caption_justify="left",
    )
    for header in (
        "mode",
        "turns 2+ cached",
        "turns 2+ TTFT p50 ms",
        "turn 1 TTFT p50 ms",
        "templates from pinned",
        "template TTFT p50 ms",
        "most on a worker",
        "over bound while one idled",
    ):
        table.add_column(header, justify="left" if header == "mode" else "right")
    for row in rows:
        table.add_row(
            row["mode"],
            _pct(row["cached_share"]),
            ms_cell(row["ttft_p50_ms"]),
            ms_cell(row["turn_1_ttft_p50_ms"]),
            _pct(row["from_pinned"]),
            ms_cell(row["template_ttft_p50_ms"]),
            f"{max(row['most_outstanding'].values(), default=0)} (bound {row['queue_bound']})",
            f"{row['over_bound_while_idle']} of {row['queue_samples']}",
        )
    return table
