"""The router: a `preheat.infer` goes to the worker that holds its prefix.

Every worker of a model consumes the model's shared queue once warm, and its own queue
(`preheat.w.<node>`) from start. A request sent to the shared queue lands on any of them;
this module sends it to one worker's own queue when that worker holds what the request
starts with and can take it soon:

- **a conversation's earlier turn** (or an ad hoc system prompt): the worker that answered
  it remembered its ids. Which worker that was is kept in the *held index*, written by the
  router when the answer arrives: a key per conversation prefix (the messages up to an
  assistant turn, hashed with the model and template) -> nodename, with a time to live,
  in Redis beside the pulses (files beside the embedded broker's folders). The caller's
  process reads it, so any client process that continues the conversation finds it, and a
  worker's request path pays no write. An entry may outlive the KV it names (evicted since):
  the turn is then answered from less of a cache, never wrongly.
- **a template's pinned prefix**: the workers whose pulse says they hold it (preheat.fleet.placement
  spreads a catalog that does not fit one worker across the fleet).
- **a LoRA adapter resident** (a request that names an adapter as its model): the workers
  whose pulse lists it, so its user does not pay the adapter's read. A conversation under an
  adapter is keyed by the adapter's name: a prefix never crosses adapters.

A worker takes it when its pulse is fresh, it serves the model, and it has fewer than
`PREHEAT_ROUTE_MAX_WAITING` requests waiting beyond its rows (its own queue's depth read
from the broker, plus its engine's running and waiting rows from its pulse, or the
requests this process sent it and has no answer for, whichever is larger: the pulse is up to
a heartbeat old). Otherwise the request goes to the shared queue, and the route says why.

A routed request carries `expires` at `PREHEAT_ROUTE_TAKE_S`: when the worker has not started
it by then (it died, or stopped, with the message queued), the caller sends it again to the
shared queue under a new id, and a worker that comes back discards the first copy. A request
the worker started and then stopped beating on is sent again too.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from preheat.celery.queues import infer_queue, model_of_request, waiting_messages, worker_queue
from preheat.core.settings import Settings, get_settings
from preheat.fleet.liveness import Pulse, pulses_for, write_whole
from preheat.history.db import utcnow

log = logging.getLogger(__name__)

HELD_PREFIX = "preheat:held:"
SHARED = None  # Route.worker of the model's shared queue
FLEET_VIEW_S = 1.0  # how long one read of every pulse serves the router's choices
INFLIGHT_FORGET_S = 600.0  # a request sent and never waited for stops counting after this


@dataclass(frozen=True)
class Route:
    queue: str
    worker: str | None  # whose own queue; None: the model's shared queue
    reason: str  # why: "holds the conversation", "holds template support", "busy: …", …


# Conversation keys ---------------------------------------------------------------------


def requested_name(kwargs: dict) -> str:
    """What the request names as its model: a model, or one of its LoRA adapters (whose
    conversations are their own: a prefix never crosses adapters); a template's model."""
    named = kwargs.get("model")
    return named if isinstance(named, str) and kwargs.get("template") is None else model_of_request(kwargs)


def conversation_keys(model: str, template: str | None, messages: tuple[dict, ...] | list[dict]) -> list[str]:
    """The keys of every prefix of `messages` (as preheat.api.requests.parse_chat gives them:
    role, text, name) a worker may hold, longest first: each that ends with an assistant turn
    (a remembered answer), and a lone leading system prompt. Linear in the conversation: one
    running digest, copied at each assistant turn."""
    ends = [end for end in range(len(messages), 0, -1) if messages[end - 1]["role"] == "assistant"]
    keys = _keys_at(model, template, messages, ends)
    if template is None and len(messages) > 1 and messages[0]["role"] == "system":
        keys += _keys_at(model, None, messages, [1])
    return keys


def answered_keys(model: str, template: str | None, messages, answer: str) -> list[str]:
    """The keys the worker that gave `answer` holds now: the conversation with the answer
    (it remembered it), and an ad hoc system prompt it cached."""
    turns = [*messages, {"role": "assistant", "content": answer}]
    keys = _keys_at(model, template, turns, [len(turns)])
    if template is None and turns[0]["role"] == "system":
        keys += _keys_at(model, None, turns, [1])
    return keys


def _keys_at(model: str, template: str | None, turns, ends: list[int]) -> list[str]:
    """The key of `turns[:end]` for each end (any order), from one pass over the turns."""
    digest = hashlib.sha256(json.dumps([model, template], ensure_ascii=False).encode())
    wanted, found = set(ends), {}
    for index, turn in enumerate(turns[: max(ends, default=0)], start=1):
        digest.update(json.dumps(turn, sort_keys=True, ensure_ascii=False).encode() + b"\x1e")
        if index in wanted:
            found[index] = digest.hexdigest()
    return [found[end] for end in ends]


# The held index ------------------------------------------------------------------------


# What a held-index entry may be: a worker's nodename, short text. Anything else (a value
# someone planted, bytes that are no text, a FIFO in the embedded index's folder) is skipped,
# and the lookup goes on to the conversation's shorter keys.
MAX_HELD_VALUE = 255


def _worker_of(raw: bytes | None) -> str | None:
    if not raw or len(raw) > MAX_HELD_VALUE:
        return None
    try:
        worker = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return worker if worker.isprintable() and not any(c.isspace() for c in worker) else None


class RedisHeld:
    def __init__(self, url: str, ttl_s: float) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.ttl_s = max(1, int(ttl_s))

    def find(self, keys: list[str]) -> tuple[str, str] | None:
        """(key, worker) of the first key held by a valid entry, or None."""
        if not keys:
            return None
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:  # at most MAX_HELD_VALUE + 1 bytes of each, whatever is stored
                pipe.getrange(HELD_PREFIX + key, 0, MAX_HELD_VALUE)
            values = pipe.execute(raise_on_error=False)
        for key, raw in zip(keys, values, strict=True):
            if isinstance(raw, bytes) and (worker := _worker_of(raw)) is not None:
                return key, worker
        return None

    def put(self, keys: list[str], worker: str) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.set(HELD_PREFIX + key, worker, ex=self.ttl_s)
            pipe.execute()


class FileHeld:
    """The embedded default: a file per key, its age its time to live."""

    def __init__(self, folder: Path, ttl_s: float) -> None:
        self.folder, self.ttl_s = folder, ttl_s

    def find(self, keys: list[str]) -> tuple[str, str] | None:
        now = time.time()
        for key in keys:
            if (worker := self._read(self.folder / key, now)) is not None:
                return key, worker
        return None

    def _read(self, path: Path, now: float) -> str | None:
        """The entry's worker: a regular file (never waited on: O_NONBLOCK), fresh, short, text."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode) or now - status.st_mtime > self.ttl_s:
                return None
            return _worker_of(os.read(fd, MAX_HELD_VALUE + 1))
        except OSError:
            return None
        finally:
            os.close(fd)

    def put(self, keys: list[str], worker: str) -> None:
        for key in keys:
            write_whole(self.folder / key, worker)


def held_index_for(settings: Settings):
    broker = settings.broker
    if broker.startswith(("redis://", "rediss://")):
        return RedisHeld(broker, settings.route_held_ttl_s)
    if settings.is_embedded:
        return FileHeld(settings.broker_folder / "held", settings.route_held_ttl_s)
    return None  # a broker with no index here: conversations go to the shared queue


# The router ----------------------------------------------------------------------------


class Router:
    def __init__(self, app, settings: Settings | None = None) -> None:
        self.app, self.settings = app, settings or get_settings()
        self.pulses = pulses_for(self.settings)
        self.held = held_index_for(self.settings)
        self._fleet: tuple[float, dict[str, Pulse]] = (0.0, {})
        self._inflight: dict[str, dict[str, float]] = {}  # worker -> task id -> sent at
        self._lock = threading.Lock()

    # What each worker can take --------------------------------------------------------

    def fleet(self) -> dict[str, Pulse]:
        """Every worker's pulse, read at most once a FLEET_VIEW_S."""
        read_at, pulses = self._fleet
        if time.monotonic() - read_at > FLEET_VIEW_S and self.pulses is not None:
            try:
                pulses = self.pulses.read_all()
            except Exception as exc:  # the broker away: no worker is known to hold anything
                log.info("no pulses from the broker: %s", exc)
                pulses = {}
            self._fleet = (time.monotonic(), pulses)
        return pulses

    def _fresh(self, pulse: Pulse | None, now: dt.datetime) -> bool:
        return pulse is not None and pulse.fresh(now, self.settings.worker_dead_after_s)

    def outstanding(self, worker: str, pulse: Pulse) -> int:
        """Requests on `worker` now: its own queue, and what runs and waits in its engine."""
        with self.app.connection_for_read() as connection:
            queued = waiting_messages(connection.default_channel, worker_queue(worker))
        return max(queued + pulse.running + pulse.waiting, self._sent_to(worker))

    def taking(self, worker: str, model: str, pulse: Pulse | None) -> tuple[int | None, str | None]:
        """(its load, None) when `worker` can take a request for `model` now; else (None, why not)."""
        if not self._fresh(pulse, utcnow()):
            return None, f"{worker} is not live"
        if model not in pulse.serving:
            return None, f"{worker} does not serve {model} now"
        bound = max(pulse.max_running, 1) + self.settings.route_max_waiting
        if (load := self.outstanding(worker, pulse)) >= bound:
            return None, f"{worker} is busy ({load} requests, bound {bound})"
        return load, None

    # Choosing -------------------------------------------------------------------------

    def parse(self, kwargs: dict):
        """The request parsed by the task's own schema (the route's): a field that is wrong is
        refused here by name (BadTaskArguments), before anything is hashed or sent. Returns the
        chat form's messages as the worker reads them, or None for the template form."""
        from preheat.api.infer import InferArguments
        from preheat.celery.task import parse_arguments

        call = parse_arguments("preheat.infer", InferArguments, kwargs)
        if (ask := getattr(call, "ask", None)) is not None and call.template is not None:
            check_template_form(ask, call.template, model_of_request(kwargs))
        return ask.messages if ask is not None else None

    def route(self, kwargs: dict, messages: tuple[dict, ...] | None = None) -> Route:
        """Where the request goes (see the module doc); `messages`: as `parse` gives them."""
        model = model_of_request(kwargs)
        shared = infer_queue(model)
        if not self.settings.routing:
            return Route(shared, SHARED, "routing off (PREHEAT_ROUTING)")
        template, named, why = kwargs.get("template"), requested_name(kwargs), "no worker holds its prefix"
        if messages is not None and self.held is not None:
            worker = self._find_held(conversation_keys(named, template, messages))
            if worker is not None:
                _, why = self.taking(worker, model, self.fleet().get(worker) or self._pulse(worker))
                if why is None:
                    return Route(worker_queue(worker), worker, "holds the conversation")
        if template is not None:  # its holder still has the template's prefix, if not the turn
            return self._route_to_holder(model, shared, f"template {template}", lambda pulse: template in pulse.holds)
        if named != model:  # an adapter: where it is resident, its user does not pay its read
            return self._route_to_holder(model, shared, f"adapter {named}", lambda pulse: named in pulse.adapters)
        return Route(shared, SHARED, why)

    def _find_held(self, keys: list[str]) -> str | None:
        try:
            found = self.held.find(keys)
        except Exception as exc:
            log.info("held index not read: %s", exc)
            return None
        return found[1] if found else None

    def _pulse(self, worker: str) -> Pulse | None:
        try:
            return self.pulses.read(worker) if self.pulses is not None else None
        except Exception:
            return None

    def _route_to_holder(self, model: str, shared: str, what: str, holds) -> Route:
        """To the least loaded worker of `model` whose pulse `holds` (a template's prefix, an
        adapter resident) and that can take it; to the shared queue when none, or all, do."""
        fleet, now = self.fleet(), utcnow()
        serving = [w for w, pulse in fleet.items() if self._fresh(pulse, now) and model in pulse.serving]
        holders = sorted(worker for worker in serving if holds(fleet[worker]))
        if not holders:
            return Route(shared, SHARED, f"no worker holds {what}")
        if len(holders) == len(serving):
            # Every worker holds it: the shared queue, which each pulls from when it has a free
            # thread, balances better than a push by loads a heartbeat old.
            return Route(shared, SHARED, f"every worker holds {what}")
        reasons, best = [], None
        for worker in holders:
            load, reason = self.taking(worker, model, fleet[worker])
            if reason is not None:
                reasons.append(reason)
            elif best is None or load < best[0]:
                best = (load, worker)
        if best is None:
            return Route(shared, SHARED, "; ".join(reasons))
        return Route(worker_queue(best[1]), best[1], f"holds {what}")

    # Sending --------------------------------------------------------------------------

    def send(self, kwargs: dict, **options) -> RoutedCall:
        messages = self.parse(kwargs)
        route = self.route(kwargs, messages)
        return RoutedCall(self, kwargs, route, self._send(kwargs, route, options), options, messages)

    def _send(self, kwargs: dict, route: Route, options: dict):
        task_id = str(uuid.uuid4())
        if route.worker is not None:
            # A worker that takes it later than this (back from a stop) discards it: by
            # then the caller has sent it again to the shared queue.
            options = {**options, "expires": utcnow() + dt.timedelta(seconds=self.settings.route_take_s)}
            self._count(route.worker, task_id)
        return self.app.send_task("preheat.infer", kwargs=kwargs, queue=route.queue, task_id=task_id, **options)

    def _count(self, worker: str, task_id: str) -> None:
        with self._lock:
            self._inflight.setdefault(worker, {})[task_id] = time.monotonic()

    def done(self, worker: str | None, task_id: str) -> None:
        with self._lock:
            self._inflight.get(worker or "", {}).pop(task_id, None)

    def _sent_to(self, worker: str) -> int:
        with self._lock:
            sent = self._inflight.get(worker, {})
            for task_id, at in list(sent.items()):
                if time.monotonic() - at > INFLIGHT_FORGET_S:
                    del sent[task_id]
            return len(sent)

    def remember(self, kwargs: dict, messages: tuple[dict, ...] | None, answer: dict) -> None:
        """The worker that answered a chat request holds its turn now: the next turn finds it."""
        if self.held is None or messages is None or not answer.get("worker"):
            return
        try:
            text = answer["choices"][0]["message"]["content"]
            self.held.put(
                answered_keys(requested_name(kwargs), kwargs.get("template"), messages, text), answer["worker"]
            )
        except Exception as exc:  # the index is an optimisation: the answer stands
            log.info("held index not written: %s", exc)


class RoutedCall:
    """A sent `preheat.infer` and its route; `get` waits for the answer, sending it again
    to the shared queue when the worker it was sent to does not take it in time."""

    def __init__(self, router: Router, kwargs: dict, route: Route, result, options: dict, messages=None) -> None:
        self.router, self.kwargs, self.route, self.result, self.options = router, kwargs, route, result, options
        self.messages = messages  # the chat form's, as parsed
        self.routes = [route]  # every route it took: a re-send adds one

    @property
    def id(self) -> str:
        return self.result.id

    def get(self, timeout: float = 600.0) -> dict:
        from celery.exceptions import TimeoutError as ResultTimeout

        deadline = time.monotonic() + timeout
        take_s = self.router.settings.route_take_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResultTimeout(f"no answer within {timeout:g} s")
                try:
                    answer = self.result.get(timeout=min(left, take_s) if self.route.worker else left)
                    break
                except ResultTimeout:
                    if self.route.worker is None:
                        raise
                    self._resend_if_not_taken()
        finally:
            self.router.done(self.route.worker, self.result.id)
        self.router.remember(self.kwargs, self.messages, answer)
        return answer

    def _resend_if_not_taken(self) -> None:
        worker = self.route.worker
        state = self.result.state
        if state == "STARTED":
            pulse = self.router._pulse(worker)
            if self.router._fresh(pulse, utcnow()):
                return  # it runs there: wait on
            why = f"re-sent: {worker} stopped beating while running it"
        else:
            why = f"re-sent: {worker} did not take it within {self.router.settings.route_take_s:g} s"
        log.warning("preheat.infer[%s] %s", self.result.id, why)
        self.router.done(worker, self.result.id)
        self.route = Route(infer_queue(model_of_request(self.kwargs)), SHARED, why)
        self.routes.append(self.route)
        self.result = self.router._send(self.kwargs, self.route, self.options)


def check_template_form(ask, template: str, model: str) -> None:
    """preheat's template rule on the caller (the worker applies it too): another model, or a
    system message beside the template's, refused here by name, unsent."""
    from preheat.api.requests import ApiError, with_template
    from preheat.celery.task import BadTaskArguments

    try:
        with_template(ask, template, model, "")
    except ApiError as exc:
        raise BadTaskArguments(f"preheat.infer: {exc.message}") from None


_ROUTERS: dict[int, Router] = {}


def send_infer(app, kwargs: dict, **options) -> RoutedCall:
    """Send `preheat.infer` where its prefix is held (see the module doc); `.get()` the answer."""
    router = _ROUTERS.get(id(app))
    if router is None:
        router = _ROUTERS[id(app)] = Router(app)
    return router.send(kwargs, **options)
