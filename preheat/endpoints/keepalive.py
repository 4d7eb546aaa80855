"""Keep-alive: one short prompt per template through an endpoint's pool, within its active
hours, so the connections and the provider's prompt cache stay warm. A sleeping server gets
none."""

from __future__ import annotations

import statistics
from contextlib import ExitStack
from dataclasses import dataclass

import httpx

from preheat.core.catalog import Catalog, EndpointSpec
from preheat.core.errors import ConfigError
from preheat.endpoints.pools import POOLS, EndpointError, EndpointPool, build_client, primer_for, reason, stream_chat
from preheat.endpoints.sleep import is_sleeping


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
            return KeepAlive(0, len(spec.templates) or 1, skipped=False, error=reason(exc))
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
            return is_sleeping(client, name, spec)
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
            errors.append(f"{template}: {reason(exc)}")
    return ttfts, errors
