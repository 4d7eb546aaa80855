"""Remote model servers (vLLM, hosted OpenAI-compatible APIs, other `preheat serve`s):
their connection pools, opened ahead of time, and what every request through one shares.
The warmups (preheat.endpoints.warmup), keep-alive pings (.keepalive) and vLLM's sleep mode
(.sleep) each have a module of their own.

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
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx

from preheat.core.catalog import Catalog, EndpointSpec
from preheat.core.errors import ConfigError

log = logging.getLogger(__name__)

# The cheapest authenticated-or-not route of each kind, used to open connections.
OPEN_PATHS = {"preheat": "/health/live", "vllm": "/health", "openai": None}  # None: GET {base_url}/models


class EndpointError(Exception):
    """The server answered, but not with what a warmup needs (an HTTP error, a bad stream)."""


def secret_from_env(endpoint: str, variable: str | None, what: str) -> str | None:
    if variable is None:
        return None
    value = os.environ.get(variable)
    if not value:
        raise ConfigError(f"endpoint {endpoint!r}: {what} variable {variable} is not set")
    return value


def build_client(name: str, spec: EndpointSpec) -> httpx.Client:
    api_key = secret_from_env(name, spec.api_key_env, "api_key_env")
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


def reason(exc: Exception) -> str:
    """One line for a failure talking to an endpoint: ours as they are, the client's with its type."""
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, EndpointError | ConfigError) else str(exc)


def root_url(spec: EndpointSpec, path: str) -> str:
    """`path` at the server's root, not under its API's base (/v1): /metrics, /sleep, ..."""
    return str(httpx.URL(spec.base_url).copy_with(path=path, query=None))


def metric_samples(text: str) -> list:
    """Every sample of a Prometheus text exposition (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
