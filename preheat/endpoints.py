"""Remote model servers (vLLM, hosted OpenAI-compatible APIs, other `preheat serve`s):
connection pools opened ahead of time, warmup prompts that prime their prefix caches,
and keep-alive pings.

One pool per endpoint per process (`POOLS`), shared by every warmup, probe and ping in
it, closed on shutdown. "Opened ahead" means really established: `min_connections` TCP
(+TLS) connections exist in the pool before the first request, made by holding that many
requests open at once on the server's cheapest route and then returning them idle.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import ssl
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field

import httpx

from preheat.catalog import Catalog, EndpointSpec
from preheat.errors import ConfigError

log = logging.getLogger(__name__)

# The cheapest authenticated-or-not route of each kind, used to open connections.
OPEN_PATHS = {"preheat": "/health/live", "vllm": "/health", "openai": None}  # None: GET {base_url}/models


class EndpointError(Exception):
    """The server answered, but not with what a warmup needs (an HTTP error, a bad stream)."""


def _secret_from_env(endpoint: str, variable: str | None, what: str) -> str | None:
    if variable is None:
        return None
    value = os.environ.get(variable)
    if not value:
        raise ConfigError(f"endpoint {endpoint!r}: {what} variable {variable} is not set")
    return value


def build_client(name: str, spec: EndpointSpec) -> httpx.Client:
    api_key = _secret_from_env(name, spec.api_key_env, "api_key_env")
    verify: ssl.SSLContext | bool = True
    if spec.ca_bundle:
        try:
            verify = ssl.create_default_context(cafile=spec.ca_bundle)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"endpoint {name!r}: cannot load ca_bundle {spec.ca_bundle}: {exc}") from None
    return httpx.Client(
        base_url=spec.base_url.rstrip("/") + "/",
        headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
        limits=httpx.Limits(
            max_connections=spec.max_connections,
            max_keepalive_connections=spec.max_connections,
            keepalive_expiry=spec.keepalive_expiry_s,
        ),
        http2=spec.http2,
        verify=verify,
        timeout=httpx.Timeout(spec.timeout_s, connect=min(10.0, spec.timeout_s)),
    )


def open_url(spec: EndpointSpec) -> str:
    path = OPEN_PATHS[spec.kind]
    if path is None:
        return "models"
    return str(httpx.URL(spec.base_url).copy_with(path=path, query=None))


@dataclass
class EndpointPool:
    name: str
    spec: EndpointSpec
    client: httpx.Client
    opened_ms: float = 0.0  # establishing the min_connections
    # Leases held now (warmups and keep-alives run on several pool threads); a pool
    # discarded or replaced while leased is closed when its last lease ends.
    leases: int = 0
    retired: bool = False

    def connections(self) -> list:
        # httpx keeps its connections in httpcore's pool; `connections` is public there.
        return list(self.client._transport._pool.connections)

    def open_connections(self) -> int:
        return sum(1 for connection in self.connections() if not connection.is_closed())

    def establish(self, primer: dict | None = None) -> float:
        """Open `min_connections` connections now and check the server answers; returns the
        milliseconds it took. Each request is held open until all are, so each needs a
        connection of its own. With a `primer` (`primer_for`: a one-token request of the
        real shape) each connection also carries a real request, and the server has just
        served one like those to come. Without one, a small POST to the open route (answered
        404/405, computing nothing): measured, the first request with a body on a connection
        paid about 1-4 ms more than later ones, which a GET did not take away."""
        started = time.perf_counter()
        method, url, body = ("POST", "chat/completions", primer) if primer else ("POST", open_url(self.spec), {})
        with ExitStack() as held:
            responses = [
                held.enter_context(self.client.stream(method, url, json=body)) for _ in range(self.spec.min_connections)
            ]
            # Only now read them: a body read to its end hands its connection back (idle, kept
            # alive); one closed unread would be dropped.
            for response in responses:
                lines = list(response.iter_lines())  # as a streamed reply is read (stream_chat)
                if response.status_code >= (400 if primer else 500):
                    raise EndpointError(
                        f"{method} {response.url.path} answered {response.status_code}: {' '.join(lines)[:200]}"
                    )
        if self.spec.min_connections and not primer:  # a primer's answer already showed the server serves
            checked = self.client.get(open_url(self.spec))
            if checked.status_code >= 400:
                raise EndpointError(f"GET {checked.url.path} answered {checked.status_code}: {checked.text[:200]}")
        self.opened_ms = (time.perf_counter() - started) * 1000
        return self.opened_ms

    def close(self) -> None:
        self.client.close()


def chat_body(model: str, system_prompt: str, user_input: str, max_tokens: int) -> dict:
    """A streamed, greedy chat request with usage, as every warmup, probe and ping sends it."""
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": user_input}],
    }


def primer_for(spec: EndpointSpec, catalog: Catalog) -> dict | None:
    """The endpoint's first template as a one-token request: what opens its connections.
    A request of the real shape, not a token 'Hi': measured on preheat serve, the first
    template request after a differently shaped one paid 4-6 ms more (the server's
    allocator had handed the larger buffers back)."""
    if not spec.templates:
        return None
    template = spec.templates[0]
    return chat_body(
        spec.model or catalog.template(template).model,
        catalog.system_prompt(template),
        catalog.template(template).probe,
        1,
    )


class EndpointPools:
    """The process's pools, by endpoint name; a changed catalog entry gets a new pool."""

    def __init__(self) -> None:
        self._pools: dict[str, EndpointPool] = {}
        self._lock = threading.Lock()

    @contextmanager
    def lease(self, name: str, spec: EndpointSpec, primer: dict | None = None) -> Iterator[tuple[EndpointPool, bool]]:
        """The pool, opening it (and its min_connections) if needed, held until exit; True
        when opened now. A pool is never closed under a caller that holds it."""
        pool, opened = self._acquire(name, spec, primer)
        try:
            yield pool, opened
        finally:
            with self._lock:
                pool.leases -= 1
                if pool.retired and not pool.leases:
                    pool.close()

    def _acquire(self, name: str, spec: EndpointSpec, primer: dict | None) -> tuple[EndpointPool, bool]:
        with self._lock:
            pool = self._pools.get(name)
            if pool is not None and pool.spec == spec:
                pool.leases += 1
                return pool, False
            if pool is not None:
                self._retire(self._pools.pop(name))
            pool = EndpointPool(name, spec, build_client(name, spec))
            try:
                pool.establish(primer)
            except Exception:
                pool.close()
                raise
            self._pools[name] = pool
            pool.leases += 1
            log.info(
                "endpoint %s: %d connection(s) open to %s in %.1f ms",
                name,
                spec.min_connections,
                spec.base_url,
                pool.opened_ms,
            )
            return pool, True

    @staticmethod
    def _retire(pool: EndpointPool) -> None:
        pool.retired = True
        if not pool.leases:
            pool.close()

    def peek(self, name: str) -> EndpointPool | None:
        return self._pools.get(name)

    def discard(self, name: str) -> None:
        with self._lock:
            pool = self._pools.pop(name, None)
            if pool is not None:
                self._retire(pool)

    def close_all(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()


POOLS = EndpointPools()
atexit.register(POOLS.close_all)


# Prompts through the pool ---------------------------------------------------------------


@dataclass(frozen=True)
class StreamedReply:
    ttft_ms: float  # request sent → first content token, through streaming
    total_ms: float
    cached_tokens: int | None  # as the server's usage reports it; None if it does not
    text: str


def stream_chat(pool: EndpointPool, model: str, system_prompt: str, user_input: str, max_tokens: int) -> StreamedReply:
    body = chat_body(model, system_prompt, user_input, max_tokens)
    started = time.perf_counter()
    first, cached, text = None, None, []
    with pool.client.stream("POST", "chat/completions", json=body) as response:
        if response.status_code >= 400:
            response.read()
            raise EndpointError(f"chat/completions answered {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    if first is None:
        raise EndpointError("the stream ended without a content token")
    return StreamedReply((first - started) * 1000, (time.perf_counter() - started) * 1000, cached, "".join(text))


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
    results = [EndpointWarmup(t, spec.model or catalog.template(t).model) for t in templates]
    with ExitStack() as held:
        try:
            pool, opened = held.enter_context(POOLS.lease(name, spec, primer_for(spec, catalog)))
        except (httpx.HTTPError, EndpointError, ConfigError) as exc:
            for result in results:
                result.error = f"cannot open connections to {spec.base_url}: {_reason(exc)}"
            return results
        for result in results:
            result.connect_ms = pool.opened_ms if opened else 0.0  # reported by the warmup that paid it
        if spec.kind == "preheat":
            _warm_through_internal(pool, results)
        else:
            with ThreadPoolExecutor(max_workers=min(len(results), spec.max_connections) or 1) as prompts:
                list(prompts.map(lambda r: _prime(pool, catalog, r), results))
    return results


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, EndpointError | ConfigError) else str(exc)


def _prime(pool: EndpointPool, catalog: Catalog, result: EndpointWarmup) -> None:
    spec = catalog.template(result.template)
    try:
        cold = stream_chat(pool, result.model, catalog.system_prompt(result.template), spec.probe, pool.spec.max_tokens)
        warm = stream_chat(pool, result.model, catalog.system_prompt(result.template), spec.probe, pool.spec.max_tokens)
    except (httpx.HTTPError, EndpointError, ValueError) as exc:
        result.error = _reason(exc)
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
        token = _secret_from_env(pool.name, pool.spec.token_env, "token_env")
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
            result.error = _reason(exc)
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


# Keep-alive ----------------------------------------------------------------------------


@dataclass(frozen=True)
class KeepAlive:
    sent: int
    failed: int
    skipped: bool  # outside the active hours, or the server asleep
    ttft_ms: float | None = None
    error: str | None = None


def keep_alive(name: str, spec: EndpointSpec, catalog: Catalog, now) -> KeepAlive:
    """One short prompt per template through the pool: keeps the connections and the
    provider's prompt cache warm. Nothing is sent outside the active hours."""
    if not spec.is_active(now) or _asleep(name, spec):
        return KeepAlive(0, 0, skipped=True)
    with ExitStack() as held:
        try:
            pool, _ = held.enter_context(POOLS.lease(name, spec, primer_for(spec, catalog)))
        except (httpx.HTTPError, EndpointError, ConfigError) as exc:
            return KeepAlive(0, len(spec.templates) or 1, skipped=False, error=_reason(exc))
        ttfts, errors = _keep_alive_prompts(pool, spec, catalog)
    return KeepAlive(
        len(ttfts),
        len(errors),
        skipped=False,
        ttft_ms=statistics.median(ttfts) if ttfts else None,
        error="; ".join(errors) or None,
    )


def _asleep(name: str, spec: EndpointSpec) -> bool:
    """A server that may sleep is asked first: a sleeping engine must get no prompt."""
    if spec.sleep is None:
        return False
    try:
        with build_client(name, spec) as client:
            return is_sleeping(client, spec)
    except (httpx.HTTPError, EndpointError, ConfigError, ValueError, KeyError):
        return False  # the prompt that follows says what is wrong


def _keep_alive_prompts(pool: EndpointPool, spec: EndpointSpec, catalog: Catalog) -> tuple[list[float], list[str]]:
    ttfts, errors = [], []
    for template in spec.templates:
        try:
            reply = stream_chat(
                pool,
                spec.model or catalog.template(template).model,
                catalog.system_prompt(template),
                catalog.template(template).probe,
                1,
            )
            ttfts.append(reply.ttft_ms)
        except (httpx.HTTPError, EndpointError, ValueError) as exc:
            errors.append(f"{template}: {_reason(exc)}")
    return ttfts, errors


# Sleep and wake (vLLM's sleep mode) ----------------------------------------------------------
#
# Over a client of its own, not the pool: the pool is opened with a primer request, and a
# sleeping server must get no request. Paths are the server's root, not the API's (/v1).


@dataclass
class EndpointSleep:
    """A sleep or a wake of one endpoint: the whole-model history row's columns."""

    status: str = "failed"  # asleep | awake | skipped | failed
    sleep_level: int | None = None
    sleep_ms: float | None = None
    wake_ms: float | None = None
    error: str | None = None

    def as_record(self) -> dict:
        return asdict(self)


DEV_MODE_OFF = (
    "the server has no sleep mode (404 on {path}): start vLLM with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode"
)


def _root(spec: EndpointSpec, path: str) -> str:
    return str(httpx.URL(spec.base_url).copy_with(path=path, query=None))


def _call(client: httpx.Client, spec: EndpointSpec, method: str, path: str, **how) -> httpx.Response:
    response = client.request(method, _root(spec, path), **how)
    if response.status_code == 404:
        raise EndpointError(DEV_MODE_OFF.format(path=path))
    if response.status_code >= 400:
        raise EndpointError(f"{method} {path} answered {response.status_code}: {response.text[:200]}")
    return response


def is_sleeping(client: httpx.Client, spec: EndpointSpec) -> bool:
    return bool(_call(client, spec, "GET", "/is_sleeping").json()["is_sleeping"])


def sleep_endpoint(name: str, spec: EndpointSpec, level: int | None = None) -> EndpointSleep:
    """`POST /sleep?level=N&mode=M`, then `/is_sleeping` must say so; a server already asleep
    is `skipped`. Never raises: the failure is the record (one line, no retry loop)."""
    if spec.sleep is None:
        return EndpointSleep(error=f"endpoint {name!r} declares no sleep ([endpoints.{name}.sleep])")
    result = EndpointSleep(sleep_level=level or spec.sleep.level)
    try:
        with build_client(name, spec) as client:
            if is_sleeping(client, spec):
                result.status, result.error = "skipped", "asleep already"
                return result
            started = time.perf_counter()
            _call(client, spec, "POST", "/sleep", params={"level": result.sleep_level, "mode": spec.sleep.mode})
            if not is_sleeping(client, spec):
                raise EndpointError("POST /sleep answered 200, but /is_sleeping says it is awake")
            result.sleep_ms = (time.perf_counter() - started) * 1000
    except (httpx.HTTPError, EndpointError, ConfigError, ValueError, KeyError) as exc:
        result.error = _reason(exc)
        return result
    POOLS.discard(name)  # its connections would carry keep-alive prompts to a sleeping server
    result.status = "asleep"
    return result


def sleep_level_of(client: httpx.Client, spec: EndpointSpec) -> int | None:
    """The level the server sleeps at, from `vllm:engine_sleep_state` on /metrics (None when
    it does not say)."""
    levels = {"weights_offloaded": 1, "discard_all": 2}
    for sample in _samples(_call(client, spec, "GET", "/metrics").text):
        if (
            sample.name == "vllm:engine_sleep_state"
            and sample.value == 1
            and sample.labels.get("sleep_state") in levels
        ):
            return levels[sample.labels["sleep_state"]]
    return None


def _samples(text: str) -> list:
    """Every sample of a Prometheus text exposition (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def wake_endpoint(name: str, spec: EndpointSpec) -> EndpointSleep:
    """`POST /wake_up` (level 2: weights, `reload_weights`, the KV cache, then
    `/reset_prefix_cache`), polled with `/is_sleeping` up to the wake timeout. The prefix
    cache is cold after it: the caller primes the templates again (`wake_and_prime`)."""
    if spec.sleep is None:
        return EndpointSleep(error=f"endpoint {name!r} declares no sleep ([endpoints.{name}.sleep])")
    result = EndpointSleep()
    try:
        with build_client(name, spec) as client:
            if not is_sleeping(client, spec):
                result.status, result.error = "skipped", "awake already"
                return result
            result.sleep_level = sleep_level_of(client, spec) or spec.sleep.level
            started = time.perf_counter()
            if result.sleep_level == 2:
                _call(client, spec, "POST", "/wake_up", params={"tags": "weights"})
                _call(client, spec, "POST", "/collective_rpc", json={"method": "reload_weights"})
                _call(client, spec, "POST", "/wake_up", params={"tags": "kv_cache"})
                _call(client, spec, "POST", "/reset_prefix_cache")
            else:
                _call(client, spec, "POST", "/wake_up")
            deadline = started + spec.sleep.wake_timeout_s
            while is_sleeping(client, spec):
                if time.perf_counter() >= deadline:
                    raise EndpointError(f"still asleep {spec.sleep.wake_timeout_s:g} s after POST /wake_up")
                time.sleep(0.05)
            result.wake_ms = (time.perf_counter() - started) * 1000
    except (httpx.HTTPError, EndpointError, ConfigError, ValueError, KeyError) as exc:
        result.error = _reason(exc)
        return result
    result.status = "awake"
    return result


def prefix_cache_counters(name: str, spec: EndpointSpec) -> tuple[float, float] | None:
    """(hits, queries) of vLLM's prefix cache, in tokens, from /metrics (None if absent)."""
    try:
        with build_client(name, spec) as client:
            text = client.get(_root(spec, "/metrics")).text
    except httpx.HTTPError:
        return None
    wanted = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    values = {metric: 0.0 for metric in wanted}
    seen = set()
    for sample in _samples(text):
        if sample.name in values:  # summed over engines and models
            values[sample.name] += sample.value
            seen.add(sample.name)
    return (values[wanted[0]], values[wanted[1]]) if len(seen) == 2 else None


def wake_and_prime(
    name: str, spec: EndpointSpec, catalog: Catalog, templates: list[str]
) -> tuple[EndpointSleep, list[EndpointWarmup]]:
    """A wake is a warmup: the server woken, then every template primed, each `warm` only on
    the server's own evidence that its prefix is cached: `cached_tokens` where the server
    returns it, else the growth of `vllm:prefix_cache_hits_total` while priming."""
    woken = wake_endpoint(name, spec)
    if woken.status == "failed":
        results = [EndpointWarmup(t, spec.model or catalog.template(t).model) for t in templates]
        for result in results:
            result.error = f"not primed: the wake failed ({woken.error})"
        return woken, results
    before = prefix_cache_counters(name, spec)
    results = warm_endpoint(name, spec, catalog, templates)
    after = prefix_cache_counters(name, spec)
    hits = None if before is None or after is None else after[0] - before[0]
    for result in results:
        if result.status == "warm" and result.cached_tokens is None and not hits:
            result.status = "degraded"
            result.error = (
                "no evidence the prefix is cached after the wake: no cached_tokens in usage "
                "(--enable-prompt-tokens-details) and vllm:prefix_cache_hits_total did not grow"
            )
    return woken, results
