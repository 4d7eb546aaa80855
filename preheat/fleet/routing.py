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


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _normal(message: dict) -> dict:
    """A message as the chat template reads it (preheat.workers.protocol keeps role, text, name)."""
    turn = {"role": message.get("role"), "content": _text(message.get("content"))}
    if message.get("name"):
        turn["name"] = message["name"]
    return turn


def _key(model: str, template: str | None, messages: list[dict]) -> str:
    text = json.dumps([model, template, messages], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def conversation_keys(model: str, template: str | None, messages: list[dict]) -> list[str]:
    """The keys of every prefix of `messages` a worker may hold, longest first: each that
    ends with an assistant turn (a remembered answer), and a lone leading system prompt."""
    turns = [_normal(m) for m in messages if isinstance(m, dict)]
    keys = [
        _key(model, template, turns[:end]) for end in range(len(turns), 0, -1) if turns[end - 1]["role"] == "assistant"
    ]
    if template is None and len(turns) > 1 and turns[0]["role"] == "system":
        keys.append(_key(model, None, turns[:1]))
    return keys


def answered_keys(model: str, template: str | None, messages: list[dict], answer: str) -> list[str]:
    """The keys the worker that gave `answer` holds now: the conversation with the answer
    (it remembered it), and an ad hoc system prompt it cached."""
    turns = [*(_normal(m) for m in messages), {"role": "assistant", "content": answer}]
    keys = [_key(model, template, turns)]
    if template is None and turns[0]["role"] == "system":
        keys.append(_key(model, None, turns[:1]))
    return keys


# The held index ------------------------------------------------------------------------


class RedisHeld:
    def __init__(self, url: str, ttl_s: float) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.ttl_s = max(1, int(ttl_s))

    def find(self, keys: list[str]) -> tuple[str, str] | None:
        """(key, worker) of the first key held, or None."""
        if not keys:
            return None
        for key, worker in zip(keys, self.client.mget([HELD_PREFIX + k for k in keys]), strict=True):
            if worker:
                return key, worker.decode()
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
            path = self.folder / key
            try:
                if now - path.stat().st_mtime <= self.ttl_s:
                    return key, path.read_text()
            except OSError:
                continue
        return None

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

    def route(self, kwargs: dict) -> Route:
        model = model_of_request(kwargs)
        shared = infer_queue(model)
        if not self.settings.routing:
            return Route(shared, SHARED, "routing off (PREHEAT_ROUTING)")
        template, why = kwargs.get("template"), "no worker holds its prefix"
        if "messages" in kwargs and self.held is not None:
            worker = self._find_held(conversation_keys(model, template, kwargs["messages"]))
            if worker is not None:
                _, why = self.taking(worker, model, self.fleet().get(worker) or self._pulse(worker))
                if why is None:
                    return Route(worker_queue(worker), worker, "holds the conversation")
        if template is not None:  # its holder still has the template's prefix, if not the turn
            return self._route_template(model, template, shared)
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

    def _route_template(self, model: str, template: str, shared: str) -> Route:
        fleet, now = self.fleet(), utcnow()
        serving = [w for w, pulse in fleet.items() if self._fresh(pulse, now) and model in pulse.serving]
        holders = sorted(worker for worker in serving if template in fleet[worker].holds)
        if not holders:
            return Route(shared, SHARED, f"no worker holds template {template}")
        if len(holders) == len(serving):
            # Every worker holds it: the shared queue, which each pulls from when it has a free
            # thread, balances better than a push by loads a heartbeat old.
            return Route(shared, SHARED, f"every worker holds template {template}")
        reasons, best = [], None
        for worker in holders:
            load, reason = self.taking(worker, model, fleet[worker])
            if reason is not None:
                reasons.append(reason)
            elif best is None or load < best[0]:
                best = (load, worker)
        if best is None:
            return Route(shared, SHARED, "; ".join(reasons))
        return Route(worker_queue(best[1]), best[1], f"holds template {template}")

    # Sending --------------------------------------------------------------------------

    def send(self, kwargs: dict, **options) -> RoutedCall:
        route = self.route(kwargs)
        return RoutedCall(self, kwargs, route, self._send(kwargs, route, options), options)

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

    def remember(self, kwargs: dict, answer: dict) -> None:
        """The worker that answered a chat request holds its turn now: the next turn finds it."""
        if self.held is None or "messages" not in kwargs or not answer.get("worker"):
            return
        try:
            model = model_of_request(kwargs)
            text = answer["choices"][0]["message"]["content"]
            self.held.put(answered_keys(model, kwargs.get("template"), kwargs["messages"], text), answer["worker"])
        except Exception as exc:  # the index is an optimisation: the answer stands
            log.info("held index not written: %s", exc)


class RoutedCall:
    """A sent `preheat.infer` and its route; `get` waits for the answer, sending it again
    to the shared queue when the worker it was sent to does not take it in time."""

    def __init__(self, router: Router, kwargs: dict, route: Route, result, options: dict) -> None:
        self.router, self.kwargs, self.route, self.result, self.options = router, kwargs, route, result, options
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
        self.router.remember(self.kwargs, answer)
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


_ROUTERS: dict[int, Router] = {}


def send_infer(app, kwargs: dict, **options) -> RoutedCall:
    """Send `preheat.infer` where its prefix is held (see the module doc); `.get()` the answer."""
    router = _ROUTERS.get(id(app))
    if router is None:
        router = _ROUTERS[id(app)] = Router(app)
    return router.send(kwargs, **options)
