"""Sleep and wake of a vLLM server (its sleep mode), and a wake that primes its templates again.

Over a client of its own, not the pool: the pool is opened with a primer request, and a
sleeping server must get no request. Paths are the server's root, not the API's (/v1).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import httpx

from preheat.core.catalog import Catalog, EndpointSpec
from preheat.core.errors import ConfigError
from preheat.endpoints.pools import POOLS, EndpointError, build_client, metric_samples, reason, root_url
from preheat.endpoints.warmup import EndpointWarmup, prefix_cache_counters, warm_endpoint


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
# The paths only vLLM's dev mode serves: a 404 on one of them means the mode is off.
SLEEP_MODE_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache")
# A wake polled from every 50 ms up to every 2 s: quick wakes are seen at once, a slow one
# (a level-2 reload) costs tens of requests over the timeout, not thousands.
POLL_FIRST_S, POLL_MOST_S = 0.05, 2.0


def _call(client: httpx.Client, name: str, spec: EndpointSpec, method: str, path: str, **how) -> httpx.Response:
    """One request to the server's root; an error names the endpoint, the method and path."""
    response = client.request(method, root_url(spec, path), **how)
    if response.status_code == 404 and path in SLEEP_MODE_PATHS:
        raise EndpointError(f"endpoint {name!r}: " + DEV_MODE_OFF.format(path=path))
    if response.status_code >= 400:
        raise EndpointError(
            f"endpoint {name!r}: {method} {path} answered {response.status_code}: {response.text[:200]}"
        )
    return response


def is_sleeping(client: httpx.Client, name: str, spec: EndpointSpec) -> bool:
    response = _call(client, name, spec, "GET", "/is_sleeping")
    try:
        answer = response.json()["is_sleeping"]
    except (ValueError, KeyError, TypeError):
        raise EndpointError(
            f"endpoint {name!r}: GET /is_sleeping answered no JSON with is_sleeping: {response.text[:100]!r}"
        ) from None
    if not isinstance(answer, bool):
        raise EndpointError(f"endpoint {name!r}: GET /is_sleeping answered is_sleeping={answer!r}, not a boolean")
    return answer


def sleep_endpoint(name: str, spec: EndpointSpec, level: int | None = None) -> EndpointSleep:
    """`POST /sleep?level=N&mode=M`, then `/is_sleeping` must say so; a server already asleep
    is `skipped`. Never raises: the failure is the record (one line, no retry loop)."""
    if spec.sleep is None:
        return EndpointSleep(error=f"endpoint {name!r} declares no sleep ([endpoints.{name}.sleep])")
    result = EndpointSleep(sleep_level=level or spec.sleep.level)
    try:
        with build_client(name, spec) as client:
            if is_sleeping(client, name, spec):
                result.status, result.error = "skipped", "asleep already"
                return result
            started = time.perf_counter()
            sleep = {"level": result.sleep_level, "mode": spec.sleep.mode}
            _call(client, name, spec, "POST", "/sleep", params=sleep)
            if not is_sleeping(client, name, spec):
                raise EndpointError(f"endpoint {name!r}: POST /sleep answered 200, but /is_sleeping says it is awake")
            result.sleep_ms = (time.perf_counter() - started) * 1000
    except (httpx.HTTPError, EndpointError, ConfigError, ValueError, KeyError) as exc:
        result.error = reason(exc)
        return result
    POOLS.discard(name)  # its connections would carry keep-alive prompts to a sleeping server
    result.status = "asleep"
    return result


def sleep_level_of(client: httpx.Client, name: str, spec: EndpointSpec) -> int | None:
    """The level the server sleeps at, from `vllm:engine_sleep_state` on /metrics; None when
    it does not say (no such metric, /metrics missing or unreadable): the caller falls back
    to the declared level, as a wake must not fail on a metrics page."""
    levels = {"weights_offloaded": 1, "discard_all": 2}
    try:
        samples = metric_samples(_call(client, name, spec, "GET", "/metrics").text)
    except (httpx.HTTPError, EndpointError, ValueError):
        return None
    for sample in samples:
        if (
            sample.name == "vllm:engine_sleep_state"
            and sample.value == 1
            and sample.labels.get("sleep_state") in levels
        ):
            return levels[sample.labels["sleep_state"]]
    return None


def wake_endpoint(name: str, spec: EndpointSpec) -> EndpointSleep:
    """`POST /wake_up` (level 2: weights, `reload_weights`, the KV cache, then
    `/reset_prefix_cache`), polled with `/is_sleeping` up to the wake timeout. The prefix
    cache is cold after it: the caller primes the templates again (`wake_and_prime`)."""
    if spec.sleep is None:
        return EndpointSleep(error=f"endpoint {name!r} declares no sleep ([endpoints.{name}.sleep])")
    result = EndpointSleep()
    try:
        with build_client(name, spec) as client:
            if not is_sleeping(client, name, spec):
                result.status, result.error = "skipped", "awake already"
                return result
            result.sleep_level = sleep_level_of(client, name, spec) or spec.sleep.level
            started = time.perf_counter()
            if result.sleep_level == 2:
                _call(client, name, spec, "POST", "/wake_up", params={"tags": "weights"})
                _call(client, name, spec, "POST", "/collective_rpc", json={"method": "reload_weights"})
                _call(client, name, spec, "POST", "/wake_up", params={"tags": "kv_cache"})
                _call(client, name, spec, "POST", "/reset_prefix_cache")
            else:
                _call(client, name, spec, "POST", "/wake_up")
            deadline, pause = started + spec.sleep.wake_timeout_s, POLL_FIRST_S
            while is_sleeping(client, name, spec):
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise EndpointError(
                        f"endpoint {name!r}: still asleep {spec.sleep.wake_timeout_s:g} s after POST /wake_up"
                    )
                time.sleep(min(pause, left))
                pause = min(pause * 2, POLL_MOST_S)
            result.wake_ms = (time.perf_counter() - started) * 1000
    except (httpx.HTTPError, EndpointError, ConfigError, ValueError, KeyError) as exc:
        result.error = reason(exc)
        return result
    result.status = "awake"
    return result


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
