"""Warmup tasks: `preheat.warm_worker`, `preheat.sleep_worker` and `preheat.wake_worker` run
on one worker; `preheat.warm_fleet` fans out."""

from __future__ import annotations

from preheat.celery import DB_RETRY, app
from preheat.dispatch import dispatch_warmup
from preheat.models import TriggerKind
from preheat.states import WHOLE_MODEL
from tasks.arguments import SleepWorkerArguments, WakeWorkerArguments, WarmFleetArguments, WarmWorkerArguments
from tasks.runtime import get_runtime


@app.task(bind=True, name="preheat.warm_worker", arguments=WarmWorkerArguments, **DB_RETRY)
def warm_worker(self, run_id: str, worker: str, templates: list[str], only_if_cold: bool = False) -> dict:
    """Make this worker warm for `templates`: model resident, prefixes pre-filled, probe measured."""
    if not self.start_jobs(run_id, worker, templates):
        return {}
    statuses = {}
    for template in templates:
        result = get_runtime().warm_template(template, only_if_cold=only_if_cold)
        self.finish_job(run_id, worker, template, result.status, result.as_record())
        statuses[template] = result.status
    return statuses


@app.task(bind=True, name="preheat.sleep_worker", arguments=SleepWorkerArguments, **DB_RETRY)
def sleep_worker(self, run_id: str, worker: str, models: list[str], level: int = 1) -> dict:
    """Put `models` to sleep on this worker: its requests finished, KV freed, weights off the device."""
    if not self.start_jobs(run_id, worker, [WHOLE_MODEL]):
        return {}
    statuses = {}
    for model in models:
        result = get_runtime().sleep(model, level)
        self.finish_job(run_id, worker, WHOLE_MODEL, result.status, result.as_record(), model=model)
        statuses[model] = result.status
    return statuses


@app.task(bind=True, name="preheat.wake_worker", arguments=WakeWorkerArguments, **DB_RETRY)
def wake_worker(self, run_id: str, worker: str, models: list[str], templates: list[str]) -> dict:
    """Wake `models` on this worker, then warm `templates` (theirs): a wake is a warmup."""
    if not self.start_jobs(run_id, worker, [WHOLE_MODEL, *templates]):
        return {}
    runtime, statuses = get_runtime(), {}
    for model in models:
        woken = runtime.wake(model)
        self.finish_job(run_id, worker, WHOLE_MODEL, woken.status, woken.as_record(), model=model)
        statuses[model] = woken.status
    for template in templates:
        result = runtime.warm_template(template)
        self.finish_job(run_id, worker, template, result.status, result.as_record())
        statuses[template] = result.status
    return statuses


@app.task(bind=True, name="preheat.warm_fleet", arguments=WarmFleetArguments, **DB_RETRY)
def warm_fleet(
    self,
    templates: list[str] | None = None,
    trigger: str = "schedule",
    detail: dict | None = None,
    requested_by: str = "beat",
    workers: list[str] | None = None,
    only_if_cold: bool = False,
) -> str:
    """List live workers and send each its own warm_worker job (for clients that only send tasks;
    beat and the watchers dispatch in their own process)."""
    dispatched = dispatch_warmup(
        templates=templates,
        workers=workers,
        trigger=TriggerKind(trigger),
        requested_by=requested_by,
        detail=detail,
        only_if_cold=only_if_cold,
    )
    return str(dispatched.run_id)
