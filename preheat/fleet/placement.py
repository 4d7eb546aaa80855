"""Which worker pins which template: the fleet's plan when a catalog does not fit one worker.

Every worker pinning every template is the simple case, and the right one while they fit.
A catalog with a system prompt per tenant does not: its prefixes exceed one worker's pinned
budget (PREHEAT_KV_CACHE_* × the pinned share) many times over. Then each template is
pinned on at least one worker, the busiest on more, ranked by `rank` (request rate ×
measured prefill time: the time pre-filling saves), and requests for a template go to a
worker that holds it (preheat.fleet.routing).

The plan is a pure function of what every worker can read: the live workers and their
pinned budgets (the registry), the templates' sizes (measured in history, else estimated
by the worker from its model) and their rank. So each worker computes the same plan and
takes its own share; no coordinator, and a worker joining or leaving changes the plan at
the next heartbeat of each.
"""

from __future__ import annotations

import datetime as dt
import statistics
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from preheat.core.catalog import Catalog
from preheat.fleet import traffic
from preheat.history.db import utcnow
from preheat.history.models import JobStatus, TargetKind, WarmupJob


@dataclass(frozen=True)
class Capacity:
    """What one worker may pin: its pinned budget."""

    max_bytes: int
    max_entries: int


@dataclass(frozen=True)
class Demand:
    """One template as the plan sees it."""

    template: str
    weight: float  # what pinning it saves (rank's saved s/h; its requests/h when not measured)
    nbytes: int


def plan(
    templates: list[Demand], workers: dict[str, Capacity], eligible: dict[str, set[str]] | None = None
) -> dict[str, list[str]]:
    """Each worker's templates. First every template gets one holder, heaviest first; then,
    while room lasts, the heaviest get more holders, one more each per round. A worker is
    chosen emptiest first (by its share of entries), then carrying the least weight. A
    template that fits no worker has none (it is answered from the LRU part of the cache).
    `eligible` (template -> workers) limits a template to the workers that have its model;
    default: every worker. The same inputs give the same plan anywhere."""
    order = sorted(templates, key=lambda d: (-d.weight, d.template))
    held: dict[str, list[str]] = {worker: [] for worker in sorted(workers)}
    used = {worker: [0, 0] for worker in held}  # bytes, entries
    holders: dict[str, int] = defaultdict(int)

    def load(worker: str) -> float:
        return sum(d.weight / max(holders[d.template], 1) for d in order if d.template in held[worker])

    def room(worker: str, demand: Demand) -> bool:
        capacity, (nbytes, entries) = workers[worker], used[worker]
        return nbytes + demand.nbytes <= capacity.max_bytes and entries + 1 <= capacity.max_entries

    def place(demand: Demand) -> bool:
        allowed = eligible.get(demand.template, held) if eligible is not None else held
        candidates = [w for w in held if w in allowed and demand.template not in held[w] and room(w, demand)]
        if not candidates:
            return False
        # The emptiest first (so the busiest keep room for more holders), then the lightest.
        worker = min(candidates, key=lambda w: (used[w][1] / workers[w].max_entries, load(w), w))
        held[worker].append(demand.template)
        used[worker][0] += demand.nbytes
        used[worker][1] += 1
        holders[demand.template] += 1
        return True

    for demand in order:
        place(demand)
    while any([place(demand) for demand in order]):
        pass
    return {worker: sorted(templates) for worker, templates in held.items()}


def holders_of(planned: dict[str, list[str]]) -> dict[str, list[str]]:
    """The plan by template: who holds each."""
    found: dict[str, list[str]] = defaultdict(list)
    for worker, templates in planned.items():
        for template in templates:
            found[template].append(worker)
    return dict(found)


def weight_of(entry: TemplateRank) -> float:
    return entry.saved_s_per_hour if entry.saved_s_per_hour is not None else entry.requests_per_hour


# The rank ------------------------------------------------------------------------------


@dataclass
class TemplateRank:
    template: str
    model: str
    requests_per_hour: float
    prefix_tokens: int | None
    prefill_ms: float | None  # median of measured warmups
    cache_bytes: int | None  # median of measured warmups
    in_catalog: bool
    fits: bool | None = None  # within the pinned budget, in rank order; None when not measured

    @property
    def saved_s_per_hour(self) -> float | None:
        if self.prefill_ms is None:
            return None
        return self.requests_per_hour * self.prefill_ms / 1000


def rank(
    session: Session,
    catalog: Catalog,
    *,
    days: int,
    max_bytes: int,
    max_entries: int,
    model: str | None = None,
    until: dt.datetime | None = None,
) -> list[TemplateRank]:
    """Templates by the time pre-filling saves, over the `days` of traffic before `until`
    (default: the latest minute counted)."""
    # A model's requests are counted under its name and under its adapters' (their templates').
    named = None if model is None else [model, *(catalog.models[model].adapters if model in catalog.models else ())]
    until = until or traffic.latest_minute(session, named)
    rows = traffic.counts(session, named, until - dt.timedelta(days=days), until) if until else []
    hours = days * 24
    requests, prefix, models = defaultdict(int), {}, {}
    for row in rows:
        if row.template:
            requests[row.template] += row.requests
            prefix[row.template] = row.prefix_tokens or prefix.get(row.template)
            models[row.template] = (
                catalog.templates[row.template].model if row.template in catalog.templates else row.model
            )
    names = set(requests) | {t for t in catalog.templates if model is None or catalog.templates[t].model == model}
    measured = _measured(session)
    ranks = []
    for name in names:
        prefill, cache_bytes, tokens = measured.get(name, (None, None, None))
        ranks.append(
            TemplateRank(
                name,
                models.get(name) or catalog.templates[name].model,
                requests[name] / hours,
                prefix.get(name) or tokens,
                prefill,
                cache_bytes,
                name in catalog.templates,
            )
        )
    ranks.sort(key=lambda r: (-(r.saved_s_per_hour or 0), -r.requests_per_hour, r.template))
    used_bytes = used_entries = 0
    for entry in ranks:
        if entry.cache_bytes is None:
            continue
        entry.fits = used_bytes + entry.cache_bytes <= max_bytes and used_entries + 1 <= max_entries
        if entry.fits:
            used_bytes, used_entries = used_bytes + entry.cache_bytes, used_entries + 1
    return ranks


def _measured(session: Session) -> dict[str, tuple[float, int, int]]:
    """Per template: median prefill ms, cache bytes and cached tokens of its warm worker jobs."""
    query = (
        select(WarmupJob.template, WarmupJob.prefill_ms, WarmupJob.cache_bytes, WarmupJob.cached_tokens)
        .where(
            WarmupJob.status == JobStatus.warm,
            WarmupJob.target_kind == TargetKind.worker,
            WarmupJob.prefill_ms.is_not(None),
            WarmupJob.cache_bytes.is_not(None),
        )
        .order_by(WarmupJob.finished_at.desc())
        .limit(5000)
    )
    found = defaultdict(list)
    for template, prefill_ms, cache_bytes, tokens in session.execute(query):
        found[template].append((prefill_ms, cache_bytes, tokens))
    return {
        template: (
            statistics.median(v[0] for v in values),
            int(statistics.median(v[1] for v in values)),
            int(statistics.median(v[2] or 0 for v in values)),
        )
        for template, values in found.items()
    }


# The fleet's plan, as every worker reads it --------------------------------------------

RANK_DAYS = 7


def rounded(weight: float) -> float:
    """Two significant figures: traffic counted since the last beat does not move pins."""
    return float(f"{weight:.2g}") if weight > 0 else 0.0


def capacity_of(state: dict | None, default: Capacity) -> Capacity:
    cache = (state or {}).get("cache") or {}
    nbytes, entries = cache.get("max_pinned_bytes"), cache.get("max_pinned_entries")
    if not isinstance(nbytes, int) or not isinstance(entries, int):
        return default  # registered, not yet described: as this worker
    return Capacity(nbytes, entries)


def models_of_state(state: dict | None) -> set[str]:
    """The models a worker's heartbeat says it has: resident, asleep, or unavailable."""
    state = state or {}
    return {name for part in ("models", "asleep", "unavailable") for name in (state.get(part) or {})}


def fleet_plan(
    session: Session,
    catalog: Catalog,
    sizes: dict[str, int | None],
    own: str,
    own_capacity: Capacity,
    dead_after_s: float,
) -> dict[str, list[str]]:
    """The plan over the live workers (and `own`, live or not yet recorded): their pinned
    budgets from the registry, the templates' sizes as this worker measures them (the same
    model gives every worker the same), their weights from `rank`."""
    from preheat.fleet import registry

    live = {record.nodename: record.state for record in registry.live_workers(session, dead_after_s)}
    workers = {name: capacity_of(state, own_capacity) for name, state in live.items()}
    workers[own] = own_capacity
    # A worker serves the templates of the models it has (resident, asleep or failed to
    # load); one that has not said yet is taken to have this worker's catalog.
    has = {name: models_of_state(state) for name, state in live.items()}
    has.setdefault(own, set())
    eligible = {
        name: {w for w in workers if not has.get(w) or catalog.template(name).model in has[w]}
        for name in catalog.templates
    }
    demands = [Demand(name, 0.0, sizes.get(name) or 0) for name in catalog.templates]
    if all(_fits(workers[w], [d for d in demands if w in eligible[d.template]]) for w in workers):
        return plan(demands, workers, eligible)  # the catalog fits: every worker pins all it can serve
    weights = hourly_weights(session, catalog)
    return plan([Demand(d.template, weights.get(d.template, 0.0), d.nbytes) for d in demands], workers, eligible)


def _fits(capacity: Capacity, demands: list[Demand]) -> bool:
    return len(demands) <= capacity.max_entries and sum(d.nbytes for d in demands) <= capacity.max_bytes


_WEIGHTS: dict[tuple[dt.datetime, str], dict[str, float]] = {}


def hourly_weights(session: Session, catalog: Catalog) -> dict[str, float]:
    """Each template's weight from `rank` over the traffic up to the last whole hour: every
    worker reads the same counts (the current hour's are still being written), so every
    worker computes the same plan, and pins move with the traffic at most once an hour, not
    with each request. Read once an hour per process (a week of counts is not read per beat)."""
    hour = utcnow().replace(minute=0, second=0, microsecond=0)
    key = (hour, ",".join(sorted(catalog.templates)))
    if key not in _WEIGHTS:
        until = hour - dt.timedelta(minutes=1)
        ranked = rank(session, catalog, days=RANK_DAYS, max_bytes=1, max_entries=1, until=until)
        _WEIGHTS.clear()
        _WEIGHTS[key] = {r.template: rounded(weight_of(r)) for r in ranked}
    return _WEIGHTS[key]


def held_by(session: Session, dead_after_s: float) -> dict[str, list[str]]:
    """Which live workers hold each template pinned and warm now (their heartbeats)."""
    from preheat.fleet import registry

    return holders_of(
        {
            record.nodename: ((record.state or {}).get("templates") or {}).get("held") or []
            for record in registry.live_workers(session, dead_after_s)
        }
    )
