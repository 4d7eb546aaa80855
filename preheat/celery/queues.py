"""The queues preheat's tasks travel on, named once: every worker's own, every model's shared
inference queue, and the router that sends each task to its queue.

Nothing here needs the Celery app: the router (preheat.fleet.routing), the on-demand waker
and the worker's bootstep name queues without building it.
"""

from __future__ import annotations

from preheat.core.catalog import current_catalog
from preheat.core.errors import UnknownNameError
from preheat.core.settings import get_settings
from preheat.core.text import safe_name

DEFAULT_QUEUE = "preheat"


def _queue_name(prefix: str, name: str) -> str:
    # The filesystem transport allows only [A-Za-z0-9._-] in names, so '@' and the like
    # become '_' on every transport.
    return prefix + safe_name(name)


def worker_queue(nodename: str) -> str:
    """Each worker's own durable queue: a warmup sent there waits for that worker, even
    one that is restarting (Redis fanout would drop it)."""
    return _queue_name("preheat.w.", nodename)


def infer_queue(model: str) -> str:
    """Requests for one model; a worker consumes it only once that model is warm."""
    return _queue_name("preheat.infer.", model)


# Tasks for one worker, sent to its own queue: each replica holds its own model and cache.
WORKER_TASKS = ("preheat.warm_worker", "preheat.sleep_worker", "preheat.wake_worker")


def waiting_messages(channel, queue: str) -> int:
    """Messages waiting in `queue` (0 for a queue never declared: Redis has none until a
    message is sent to it)."""
    from kombu.exceptions import ChannelError

    try:
        return int(channel.queue_declare(queue=queue, passive=True).message_count)
    except ChannelError:
        return 0


def route_task(name, args, kwargs, options, task=None, **_):
    if name in WORKER_TASKS:
        return {"queue": worker_queue(kwargs["worker"])}
    if name == "preheat.infer":
        return {"queue": infer_queue(model_of_request(kwargs, args))}
    return None


def model_of_request(kwargs: dict, args: tuple = ()) -> str:
    """The catalog model a `preheat.infer` is for: its template's, or the chat form's `model`.
    An unknown name is refused here, before anything is sent."""

    catalog = current_catalog(get_settings().catalog)
    template = kwargs.get("template") or (args[0] if args else None)
    if template is not None:
        return catalog.template(template).model
    model = kwargs.get("model")
    if not isinstance(model, str):
        raise UnknownNameError("preheat.infer needs a template or a model")
    return catalog.base_and_adapter(model)[0]  # an adapter's requests go to its base's queue
