"""Warmup tasks: `preheat.warm_worker` runs on one worker; `preheat.warm_fleet` fans out."""

from __future__ import annotations

from preheat.celery import DB_RETRY, app
from preheat.dispatch import dispatch_warmup
from preheat.models import TriggerKind
from tasks.arguments import WarmFleetArguments, WarmWorkerArguments
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
