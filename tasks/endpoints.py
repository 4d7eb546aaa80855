"""Endpoint tasks: `preheat.warm_endpoint` primes a remote model server through its pool;
`preheat.keep_alive_endpoint` (fired by beat per endpoint) keeps it warm;
`preheat.sleep_endpoint` and `preheat.wake_endpoint` drive a vLLM server's sleep mode."""

from __future__ import annotations

import logging

from preheat.celery.app import app
from preheat.celery.task import DB_RETRY
from preheat.core.catalog import load_catalog
from preheat.core.errors import UnknownNameError
from preheat.core.settings import get_settings
from preheat.core.states import WHOLE_MODEL
from preheat.endpoints.keepalive import keep_alive
from preheat.endpoints.pools import POOLS
from preheat.endpoints.sleep import sleep_endpoint, wake_and_prime
from preheat.endpoints.warmup import warm_endpoint
from preheat.history import service
from preheat.history.db import utcnow
from preheat.tasks.arguments import (
    KeepAliveArguments,
    SleepEndpointArguments,
    WakeEndpointArguments,
    WarmEndpointArguments,
)

log = logging.getLogger(__name__)


@app.task(bind=True, name="preheat.warm_endpoint", arguments=WarmEndpointArguments, **DB_RETRY)
def warm_endpoint_task(self, job: WarmEndpointArguments) -> dict:
    """Open the endpoint's pool, send the templates' prompts concurrently, record each.
    With `base_url`, warm one replica of it (a pod that just became ready), as `target`."""
    target = job.target or job.endpoint
    if not self.start_jobs(job.run_id, target, job.templates):
        return {}
    catalog = load_catalog(get_settings().catalog)
    spec = catalog.endpoint(job.endpoint)
    if job.base_url:
        spec = spec.model_copy(update={"base_url": job.base_url})
    results = warm_endpoint(target, spec, catalog, job.templates)
    if job.base_url:
        POOLS.discard(target)  # one replica's warmup; traffic reaches it through the endpoint's own pool
    for result in results:
        self.finish_job(job.run_id, target, result.template, result.status, result.as_record())
    return {result.template: result.status for result in results}


@app.task(bind=True, name="preheat.sleep_endpoint", arguments=SleepEndpointArguments, **DB_RETRY)
def sleep_endpoint_task(self, job: SleepEndpointArguments) -> dict:
    """Put a vLLM server to sleep (`POST /sleep`); its keep-alive pauses while it sleeps."""
    if not self.start_jobs(job.run_id, job.endpoint, [WHOLE_MODEL]):
        return {}
    result = sleep_endpoint(job.endpoint, load_catalog(get_settings().catalog).endpoint(job.endpoint), job.level)
    self.finish_job(job.run_id, job.endpoint, WHOLE_MODEL, result.status, result.as_record())
    return {job.endpoint: result.status}


@app.task(bind=True, name="preheat.wake_endpoint", arguments=WakeEndpointArguments, **DB_RETRY)
def wake_endpoint_task(self, job: WakeEndpointArguments) -> dict:
    """Wake a vLLM server and prime its templates again: warm only on the server's evidence."""
    if not self.start_jobs(job.run_id, job.endpoint, [WHOLE_MODEL, *job.templates]):
        return {}
    catalog = load_catalog(get_settings().catalog)
    woken, primed = wake_and_prime(job.endpoint, catalog.endpoint(job.endpoint), catalog, job.templates)
    self.finish_job(job.run_id, job.endpoint, WHOLE_MODEL, woken.status, woken.as_record())
    for result in primed:
        self.finish_job(job.run_id, job.endpoint, result.template, result.status, result.as_record())
    return {job.endpoint: woken.status, **{result.template: result.status for result in primed}}


@app.task(name="preheat.keep_alive_endpoint", arguments=KeepAliveArguments, **DB_RETRY)
def keep_alive_endpoint(job: KeepAliveArguments) -> dict:
    """One keep-alive tick: a short prompt per template within the active hours, counted."""
    endpoint = job.endpoint
    catalog = load_catalog(get_settings().catalog)
    try:
        spec = catalog.endpoint(endpoint)
    except UnknownNameError:
        log.info("endpoint %s is no longer in the catalog; no keep-alive", endpoint)
        POOLS.discard(endpoint)
        return {}
    tick = keep_alive(endpoint, spec, catalog, utcnow())
    service.report_keepalive(
        endpoint, sent=tick.sent, failed=tick.failed, skipped=tick.skipped, ttft_ms=tick.ttft_ms, error=tick.error
    )
    return {"sent": tick.sent, "failed": tick.failed, "skipped": tick.skipped}
