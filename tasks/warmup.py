"""Warmup tasks: `preheat.warm_worker`, `preheat.sleep_worker` and `preheat.wake_worker` run
on one worker; `preheat.warm_fleet` fans out."""

from __future__ import annotations

from preheat.celery.app import app
from preheat.celery.task import DB_RETRY
from preheat.core.states import WHOLE_MODEL
from preheat.fleet.dispatch import dispatch_warmup
from preheat.history.models import TriggerKind
from preheat.tasks.arguments import SleepWorkerArguments, WakeWorkerArguments, WarmFleetArguments, WarmWorkerArguments
from preheat.tasks.runtime import get_runtime


@app.task(bind=True, name="preheat.warm_worker", arguments=WarmWorkerArguments, **DB_RETRY)
def warm_worker(self, job: WarmWorkerArguments) -> dict:
    """Make this worker warm for its templates: model resident, prefixes pre-filled, probe measured."""
    if not self.start_jobs(job.run_id, job.worker, job.templates):
        return {}
    statuses = {}
    for template in job.templates:
        result = get_runtime().warm_template(template, only_if_cold=job.only_if_cold)
        self.finish_job(job.run_id, job.worker, template, result.status, result.as_record())
        statuses[template] = result.status
    return statuses


@app.task(bind=True, name="preheat.sleep_worker", arguments=SleepWorkerArguments, **DB_RETRY)
def sleep_worker(self, job: SleepWorkerArguments) -> dict:
    """Put its models to sleep on this worker: their requests finished, KV freed, weights off the device."""
    if not self.start_jobs(job.run_id, job.worker, [WHOLE_MODEL]):
        return {}
    statuses = {}
    for model in job.models:
        result = get_runtime().sleeps.sleep(model, job.level)
        self.finish_job(job.run_id, job.worker, WHOLE_MODEL, result.status, result.as_record(), model=model)
        statuses[model] = result.status
    return statuses


@app.task(bind=True, name="preheat.wake_worker", arguments=WakeWorkerArguments, **DB_RETRY)
def wake_worker(self, job: WakeWorkerArguments) -> dict:
    """Wake its models on this worker, then warm their templates: a wake is a warmup."""
    if not self.start_jobs(job.run_id, job.worker, [WHOLE_MODEL, *job.templates]):
        return {}
    runtime, statuses = get_runtime(), {}
    for model in job.models:
        woken = runtime.sleeps.wake(model)
        self.finish_job(job.run_id, job.worker, WHOLE_MODEL, woken.status, woken.as_record(), model=model)
        statuses[model] = woken.status
    for template in job.templates:
        result = runtime.warm_template(template)
        self.finish_job(job.run_id, job.worker, template, result.status, result.as_record())
        statuses[template] = result.status
    return statuses


@app.task(bind=True, name="preheat.warm_fleet", arguments=WarmFleetArguments, **DB_RETRY)
def warm_fleet(self, job: WarmFleetArguments) -> str:
    """List live workers and send each its own warm_worker job (for clients that only send tasks;
    beat and the watchers dispatch in their own process)."""
    dispatched = dispatch_warmup(
        templates=job.templates,
        workers=job.workers,
        trigger=TriggerKind(job.trigger),
        requested_by=job.requested_by,
        detail=job.detail,
        only_if_cold=job.only_if_cold,
    )
    return str(dispatched.run_id)
