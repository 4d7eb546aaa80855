"""A remote model server's warmup: its pool opened, every template's system prompt sent
(concurrently) to prime its prefix cache, and the cache proven from the server's own
evidence (`cached_tokens` in usage, else the growth of vLLM's prefix-cache counters).
A `preheat serve` warms itself through its /internal/warmup.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

import httpx

from preheat.core.catalog import Catalog, EndpointSpec
from preheat.core.errors import ConfigError
from preheat.endpoints.pools import (
    POOLS,
    EndpointError,
    EndpointPool,
    build_client,
    metric_samples,
    primer_for,
    reason,
    root_url,
    secret_from_env,
    stream_chat,
)


@dataclass
class EndpointWarmup:
    """One endpoint and template: the history job's columns."""

    template: str
    model: str
    status: str = "failed"  # warm | degraded | failed
    connect_ms: float | None = None
    ttft_cold_ms: float | None = None  # the first prompt: the server computes the prefix
    ttft_warm_ms: float | None = None  # the same prompt again: from the server's prefix cache
    ttft_bare_ms: float | None = None
    prefill_ms: float | None = None
    load_ms: float | None = None
    cached_tokens: int | None = None
    cache_bytes: int | None = None
    device: str | None = None
    error: str | None = None
    requests: dict = field(default_factory=dict)

    def as_record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("template", "model", "requests")}


def warm_endpoint(name: str, spec: EndpointSpec, catalog: Catalog, templates: list[str]) -> list[EndpointWarmup]:
    """Open the pool (if not yet), then prime the server's prefix cache with every template's
    system prompt, concurrently; never raises for an unreachable or failing server."""
    results = [
        EndpointWarmup(t, catalog.template(t).adapter or spec.model or catalog.template(t).model) for t in templates
    ]
    with ExitStack() as held:
        try:
            pool, opened = held.enter_context(POOLS.lease(name, spec, primer_for(spec, catalog)))
        except (httpx.HTTPError, EndpointError, ConfigError) as exc:
            for result in results:
                result.error = f"cannot open connections to {spec.base_url}: {reason(exc)}"
            return results
        for result in results:
            result.connect_ms = pool.opened_ms if opened else 0.0  # reported by the warmup that paid it
        if spec.kind == "preheat":
            _warm_through_internal(pool, results)
            return results
        refused = load_adapters(pool, sorted({catalog.template(r.template).adapter for r in results} - {None}))
        for result in results:
            if (why := refused.get(catalog.template(result.template).adapter)) is not None:
                result.error = why
        primed = [result for result in results if result.error is None]
        with ThreadPoolExecutor(max_workers=min(len(primed), spec.max_connections) or 1) as prompts:
            list(prompts.map(lambda r: _prime(pool, catalog, r), primed))
    return results


def load_adapters(pool: EndpointPool, adapters: list[str]) -> dict[str, str]:
    """Each adapter loaded on the server ahead of its tenants (`POST /v1/load_lora_adapter`,
    which also preloads it for the requests that follow), then seen in `GET /v1/models`
    with its base as `parent`. Returns adapter -> why it is not usable (one line each);
    an adapter the server had loaded already counts as loaded."""
    refused, root = {}, httpx.URL(pool.spec.base_url)
    for adapter in adapters:
        body = {"lora_name": adapter, "lora_path": pool.spec.adapters[adapter]}
        try:
            answer = pool.client.post(str(root.copy_with(path=_api_path(root, "load_lora_adapter"))), json=body)
        except httpx.HTTPError as exc:
            refused[adapter] = f"adapter {adapter!r}: POST /v1/load_lora_adapter failed: {reason(exc)}"
            continue
        if answer.status_code == 404:
            refused[adapter] = (
                f"adapter {adapter!r}: POST /v1/load_lora_adapter is 404: start vLLM with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
            )
        elif answer.status_code >= 400 and "already been loaded" not in answer.text:
            refused[adapter] = (
                f"adapter {adapter!r}: POST /v1/load_lora_adapter answered {answer.status_code}: {_message(answer)}"
            )
    try:
        listed = {
            entry.get("id"): entry
            for entry in pool.client.get(str(root.copy_with(path=_api_path(root, "models")))).json()["data"]
        }
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        listed = {}
        why = f"GET /v1/models failed: {reason(exc) if isinstance(exc, httpx.HTTPError) else exc!r}"
    else:
        why = "not in GET /v1/models after loading"
    for adapter in adapters:
        if adapter not in refused and adapter not in listed:
            refused[adapter] = f"adapter {adapter!r}: {why}"
    return refused


def _api_path(root: httpx.URL, leaf: str) -> str:
    """`leaf` under the API root's path (/v1/…), as vLLM serves its LoRA routes."""
    return f"{root.path.rstrip('/')}/{leaf}"


def _message(answer: httpx.Response) -> str:
    try:
        return str(answer.json().get("message", answer.text))[:200]
    except ValueError:
        return answer.text[:200]


def _prime(pool: EndpointPool, catalog: Catalog, result: EndpointWarmup) -> None:
    spec = catalog.template(result.template)
    try:
        cold = stream_chat(pool, result.model, catalog.system_prompt(result.template), spec.probe, pool.spec.max_tokens)
        warm = stream_chat(pool, result.model, catalog.system_prompt(result.template), spec.probe, pool.spec.max_tokens)
    except (httpx.HTTPError, EndpointError, ValueError) as exc:
        result.error = reason(exc)
        return
    result.ttft_cold_ms, result.ttft_warm_ms, result.cached_tokens = cold.ttft_ms, warm.ttft_ms, warm.cached_tokens
    if warm.cached_tokens == 0:
        result.status = "degraded"
        result.error = (
            "the server reported no cached prompt tokens on the repeated prompt: is its prefix cache on "
            "(vLLM: --enable-prefix-caching)?"
        )
    else:
        result.status = "warm"


def _warm_through_internal(pool: EndpointPool, results: list[EndpointWarmup]) -> None:
    """A preheat server warms itself: /internal/warmup pre-fills, probes and measures."""
    try:
        token = secret_from_env(pool.name, pool.spec.token_env, "token_env")
        response = pool.client.post(
            str(httpx.URL(pool.spec.base_url).copy_with(path="/internal/warmup")),
            json={"templates": [r.template for r in results], "batch_size": 4, "max_tokens": pool.spec.max_tokens},
            headers={"Authorization": f"Bearer {token}"} if token else {},
        )
        if response.status_code >= 400:
            raise EndpointError(f"/internal/warmup answered {response.status_code}: {response.text[:300]}")
        measured = response.json()["templates"]
    except (httpx.HTTPError, EndpointError, ConfigError, ValueError, KeyError) as exc:
        for result in results:
            result.error = reason(exc)
        return
    for result in results:
        record = measured.get(result.template, {})
        for column in (
            "status",
            "ttft_cold_ms",
            "ttft_warm_ms",
            "ttft_bare_ms",
            "prefill_ms",
            "load_ms",
            "cached_tokens",
            "cache_bytes",
            "device",
            "error",
        ):
            if column in record:
                setattr(result, column, record[column])
        result.requests = record.get("requests", {})


def prefix_cache_counters(name: str, spec: EndpointSpec) -> tuple[float, float] | None:
    """(hits, queries) of vLLM's prefix cache, in tokens, from /metrics (None if absent)."""
    try:
        with build_client(name, spec) as client:
            text = client.get(root_url(spec, "/metrics")).text
    except httpx.HTTPError:
        return None
    wanted = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    values = {metric: 0.0 for metric in wanted}
    seen = set()
    for sample in metric_samples(text):
        if sample.name in values:  # summed over engines and models
            values[sample.name] += sample.value
            seen.add(sample.name)
    return (values[wanted[0]], values[wanted[1]]) if len(seen) == 2 else None
