"""`preheat sleep` and `preheat wake`: a model off the device between peaks, and back warm.

Targets as `preheat warm` names them (templates stand for their models, or name models
directly; every live worker or those named). A wake is a warmup: the weights back, then every
template of the model restored, probed and judged, each its own job.
"""

from __future__ import annotations

import typer

from preheat.cli.warm import _requester, follow
from preheat.core.errors import ConfigError
from preheat.core.states import RunAction

MODEL = typer.Option(None, "--model", "-m", help="Catalog model (repeat; default: every model).")
TEMPLATE = typer.Option(None, "--template", "-t", help="A template, standing for its model (repeat).")
WORKER = typer.Option(None, "--worker", "-w", help="Worker nodename (repeat; default: every live one).")
ENDPOINT = typer.Option(None, "--endpoint", "-e", help="A vLLM endpoint that declares sleep, instead of workers.")
WAIT = typer.Option(False, "--wait", help="Wait for every job and print what was measured.")
TIMEOUT = typer.Option(600.0, "--timeout", min=1.0, help="Seconds --wait waits.")
REQUESTED_BY = typer.Option(None, "--requested-by", help="Recorded in history (default: user@host).")
AS_JSON = typer.Option(False, "--json", help="Print the run as JSON.")


def sleep(
    model: list[str] = MODEL,
    template: list[str] = TEMPLATE,
    worker: list[str] = WORKER,
    endpoint: list[str] = ENDPOINT,
    level: int = typer.Option(
        None,
        "--level",
        min=1,
        max=2,
        help="1 (default): KV freed, weights off the device; 2: weights dropped too. An endpoint: its declared level.",
    ),
    wait: bool = WAIT,
    timeout: float = TIMEOUT,
    requested_by: str = REQUESTED_BY,
    as_json: bool = AS_JSON,
) -> None:
    """Put models to sleep: running requests finish, the KV cache is freed, the weights leave
    the device; the worker takes none of the model's requests until woken (a request that
    comes anyway wakes one). Exit codes as `preheat warm`."""
    _act(RunAction.sleep, model, template, worker, endpoint, level, wait, timeout, requested_by, as_json)


def wake(
    model: list[str] = MODEL,
    template: list[str] = TEMPLATE,
    worker: list[str] = WORKER,
    endpoint: list[str] = ENDPOINT,
    wait: bool = WAIT,
    timeout: float = TIMEOUT,
    requested_by: str = REQUESTED_BY,
    as_json: bool = AS_JSON,
) -> None:
    """Wake models and warm their templates (restored, probed, judged), then they take
    requests again. Exit codes as `preheat warm`."""
    _act(RunAction.wake, model, template, worker, endpoint, None, wait, timeout, requested_by, as_json)


def _act(action, models, templates, workers, endpoints, level, wait, timeout, requested_by, as_json) -> None:
    from preheat.fleet.sleep import dispatch_endpoint_sleep_wake, dispatch_sleep_wake

    who = _requester() if requested_by is None else requested_by
    if endpoints:
        if workers or models:
            raise ConfigError("give --endpoint without --worker and --model: a run acts on workers or on endpoints")
        if action == RunAction.sleep and templates:
            raise ConfigError("--template with --endpoint names what a wake primes; a sleep takes none")
        dispatched = dispatch_endpoint_sleep_wake(
            action, endpoints, templates=templates or None, level=level, requested_by=who
        )
    else:
        dispatched = dispatch_sleep_wake(
            action,
            models=models or None,
            templates=templates or None,
            workers=workers or None,
            level=level or 1,
            requested_by=who,
        )
    what = f"{action} {', '.join(dispatched.models)}"
    follow(dispatched, what, endpoints=bool(endpoints), wait=wait, timeout=timeout, as_json=as_json)
