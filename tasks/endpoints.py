"""Endpoint tasks: `preheat.warm_endpoint` primes a remote model server through its pool;
`preheat.keep_alive_endpoint` (fired by beat per endpoint) keeps it warm;
`preheat.sleep_endpoint` and `preheat.wake_endpoint` drive a vLLM server's sleep mode."""

from __future__ import annotations

import logging

from preheat import history
from preheat.catalog import load_catalog
from preheat.celery import DB_RETRY, app
from preheat.db import utcnow
from preheat.endpoints import POOLS, keep_alive, sleep_endpoint, wake_and_prime, warm_endpoint
from preheat.errors import UnknownNameError
from preheat.settings import get_settings
from preheat.states import WHOLE_MODEL
from tasks.arguments import KeepAliveArguments, SleepEndpointArguments, WakeEndpointArguments, WarmEndpointArguments

log = logging.getLogger(__name__)


@app.task(bind=True, name="preheat.warm_endpoint", arguments=WarmEndpointArguments, **DB_RETRY)
def warm_endpoint_task(
    self, run_id: str, endpoint: str, templates: list[str], base_url: str | None = None, target: str | None = None
) -> dict:
    """Open the endpoint's pool, send the templates' prompts concurrently, record each.
    With `base_url`, warm one replica of it (a pod that just became ready), as `target`."""
    target = target or endpoint
    if not self.start_jobs(run_id, target, templates):
        return {}
    catalog = load_catalog(get_settings().catalog)
    spec = catalog.endpoint(endpoint)
    if base_url:
        spec = spec.model_copy(update={"base_url": base_url})
    results = warm_endpoint(target, spec, catalog, templates)
    if base_url:
        POOLS.discard(target)  # one replica's warmup; traffic reaches it through the endpoint's own pool
    for result in results:
        self.finish_job(run_id, target, result.template, result.status, result.as_record())
    return {result.template: result.status for result in results}


@app.task(bind=True, name="preheat.sleep_endpoint", arguments=SleepEndpointArguments, **DB_RETRY)
def sleep_endpoint_task(self, run_id: str, endpoint: str, level: int | None = None) -> dict:
    """Put a vLLM server to sleep (`POST /sleep`); its keep-alive pauses while it sleeps."""
    if not self.start_jobs(run_id, endpoint, [WHOLE_MODEL]):
        return {}
    result = sleep_endpoint(endpoint, load_catalog(get_settings().catalog).endpoint(endpoint), level)
    self.finish_job(run_id, endpoint, WHOLE_MODEL, result.status, result.as_record())
    return {endpoint: result.status}


@app.task(bind=True, name="preheat.wake_endpoint", arguments=WakeEndpointArguments, **DB_RETRY)
def wake_endpoint_task(self, run_id: str, endpoint: str, templates: list[str]) -> dict:
    """Wake a vLLM server and prime its templates again: warm only on the server's evidence."""
    if not self.start_jobs(run_id, endpoint, [WHOLE_MODEL, *templates]):
        return {}
    catalog = load_catalog(get_settings().catalog)
    woken, primed = wake_and_prime(endpoint, catalog.endpoint(endpoint), catalog, templates)
    self.finish_job(run_id, endpoint, WHOLE_MODEL, woken.status, woken.as_record())
    for result in primed:
        self.finish_job(run_id, endpoint, result.template, result.status, result.as_record())
    return {endpoint: woken.status, **{result.template: result.status for result in primed}}


@app.task(name="preheat.keep_alive_endpoint", arguments=KeepAliveArguments, **DB_RETRY)
def keep_alive_endpoint(endpoint: str) -> dict:
    """One keep-alive tick: a short prompt per template within the active hours, counted."""
    catalog = load_catalog(get_settings().catalog)
    try:
        spec = catalog.endpoint(endpoint)
    except UnknownNameError:
        log.info("endpoint %s is no longer in the catalog; no keep-alive", endpoint)
        POOLS.discard(endpoint)
        return {}
    tick = keep_alive(endpoint, spec, catalog, utcnow())
    history.report_keepalive(
        endpoint, sent=tick.sent, failed=tick.failed, skipped=tick.skipped, ttft_ms=tick.ttft_ms, error=tick.error
    )
    return {"sent": tick.sent, "failed": tick.failed, "skipped": tick.skipped}
