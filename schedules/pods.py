"""`preheat watch-pods`: a pod that becomes Ready gets exactly one warmup.

With the official `kubernetes` client: list the pods (namespace, label selector), then
watch from the list's resourceVersion with bookmarks on. A dropped connection is watched
again from the last resourceVersion seen (an event's or a bookmark's), with backoff; a
410 Gone (that version is compacted away) starts over with a fresh list.

A transition is a pod's Ready condition turning True, or a pod first seen Ready. It is
identified by the pod's uid and the condition's lastTransitionTime, which every later
event of the same transition repeats: a storm of MODIFIED events, a re-list after a
410, or a restarted watcher (the run's trigger key is unique) yield no second warmup.
Without a lastTransitionTime the key is the latest container start (the containers'
`state.running.startedAt`), else the pod's `startTime`, else the pod alone: never the
resourceVersion, which every unrelated update (a label, a status tick) changes. Without
lastTransitionTime a readiness flap with no container restart is therefore not warmed
again; with it, each flap is a transition.

What arrives from the API server is read as raw JSON, never through the client's typed
models: an event or a listed item that is not a valid pod (a condition that is not an
object, a Ready condition without a status, no uid) is skipped with one log line naming
the pod and the fault, and the watch goes on from the version after it. A watch that
fails again and again at one resourceVersion is given up for a fresh list. Reconnects
back off (jittered, bounded), and the backoff starts over after a watch that stayed
healthy for a while, so periodic cuts by a load balancer keep reconnects fast.
A transition waits `settle_s` before it is sent (a new server often needs a moment after
its probe first passes); if the pod turns unready or is deleted meanwhile it is dropped,
and if it flaps back to Ready, the newer transition replaces it: one warmup.

What the warmup targets is the pod's IP and port: a catalog endpoint pointed at that one
replica (vLLM, `preheat serve`, …) or, for preheat GPU worker pods, that worker's own
queue (its nodename from a template such as "gpu0@{pod}", as the StatefulSet names it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field

from kombu.exceptions import OperationalError as BrokerError

from preheat.db import DATABASE_AWAY
from preheat.errors import ConfigError, PreheatError
from preheat.models import TriggerKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadyTransition:
    namespace: str
    pod: str
    uid: str
    ready_since: str  # the Ready condition's lastTransitionTime, or ready_marker's fallback
    ip: str | None
    ports: tuple[tuple[str | None, int], ...]  # (name, containerPort) of its containers

    @property
    def trigger_key(self) -> str:
        return f"pod:{self.uid}:{self.ready_since}"

    def detail(self) -> dict:
        return {
            "namespace": self.namespace,
            "pod": self.pod,
            "uid": self.uid,
            "ready_since": self.ready_since,
            "ip": self.ip,
        }


CONDITION_STATUSES = ("True", "False", "Unknown")


def pod_problem(pod) -> str | None:
    """Why `pod` cannot be read as a pod, in a few words; None when it can. Only what the
    watcher reads is checked: identity, the conditions, the declared ports."""
    if not isinstance(pod, dict):
        return f"the object is a {type(pod).__name__}, not a pod"
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict):
        return "metadata is not an object"
    for name in ("uid", "name"):
        if not isinstance(metadata.get(name), str) or not metadata[name]:
            return f"metadata.{name} is missing"
    status = pod.get("status") or {}
    if not isinstance(status, dict):
        return "status is not an object"
    conditions = status.get("conditions") or []
    if not isinstance(conditions, list):
        return "status.conditions is not a list"
    for index, condition in enumerate(conditions):
        if not isinstance(condition, dict):
            return f"status.conditions[{index}] is not an object"
        if condition.get("type") == "Ready" and condition.get("status") not in CONDITION_STATUSES:
            return f"status.conditions[{index}] (Ready) has no valid status: {condition.get('status')!r}"
    return _ports_problem(pod.get("spec") or {})


def _ports_problem(spec) -> str | None:
    containers = spec.get("containers") or [] if isinstance(spec, dict) else None
    if not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers):
        return "spec.containers is not a list of objects"
    for container in containers:
        ports = container.get("ports") or []
        if not isinstance(ports, list) or not all(isinstance(p, dict) for p in ports):
            return f"spec.containers[{container.get('name')!r}].ports is not a list of objects"
        for port in ports:
            number = port.get("containerPort")
            if number is not None and (isinstance(number, bool) or not isinstance(number, int)):
                return f"containerPort {number!r} is not a number"
    return None


def describe_pod(pod) -> str:
    """namespace/name (uid), as far as they are known: for log lines about a bad object."""
    metadata = pod.get("metadata") if isinstance(pod, dict) else None
    if not isinstance(metadata, dict):
        return "an unnamed object"
    namespace, name, uid = (str(metadata.get(key) or "?") for key in ("namespace", "name", "uid"))
    return f"{namespace}/{name} (uid {uid})"


def is_ready(pod: dict) -> tuple[bool, str | None]:
    """Whether the pod's Ready condition is True, and since when (a stable marker of this
    transition: see ready_marker)."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True", condition.get("lastTransitionTime")
    return False, None


def ready_marker(pod: dict, last_transition: str | None) -> str:
    """What identifies this Ready transition: lastTransitionTime, else the latest container
    start, else the pod's start, else the pod itself. Never anything an unrelated update
    changes (resourceVersion, labels, status ticks)."""
    if last_transition:
        return last_transition
    status = pod.get("status") or {}
    started = [
        ((container.get("state") or {}).get("running") or {}).get("startedAt")
        for container in status.get("containerStatuses") or []
        if isinstance(container, dict) and isinstance(container.get("state"), dict)
    ]
    started = sorted(s for s in started if isinstance(s, str) and s)
    if started:
        return f"started:{started[-1]}"
    if isinstance(status.get("startTime"), str) and status["startTime"]:
        return f"pod-start:{status['startTime']}"
    return "ready"


def transition_of(pod: dict) -> ReadyTransition | None:
    ready, since = is_ready(pod)
    if not ready:
        return None
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    ports = tuple(
        (port.get("name"), int(port["containerPort"]))
        for container in (pod.get("spec") or {}).get("containers") or []
        for port in container.get("ports") or []
        if port.get("containerPort")
    )
    return ReadyTransition(
        namespace=metadata.get("namespace", ""),
        pod=metadata.get("name", ""),
        uid=metadata["uid"],
        ready_since=ready_marker(pod, since),
        ip=status.get("podIP"),
        ports=ports,
    )


@dataclass
class ReadyTracker:
    """Which transitions were seen, and which wait to be sent: pure bookkeeping, no I/O."""

    settle_s: float = 0.0
    seen: dict[str, str] = field(default_factory=dict)  # uid -> trigger key of its latest Ready transition
    pending: dict[str, tuple[float, ReadyTransition]] = field(default_factory=dict)  # uid -> (due, transition)

    def observe(self, pod: dict, now: float) -> None:
        uid = (pod.get("metadata") or {}).get("uid")
        if not uid:
            return
        transition = transition_of(pod)
        if transition is None:  # not ready (any more): a waiting transition is dropped
            self.pending.pop(uid, None)
            self.seen.pop(uid, None)
            return
        if self.seen.get(uid) == transition.trigger_key:
            return  # the same transition again: a storm of MODIFIED events, or a re-list
        self.seen[uid] = transition.trigger_key
        self.pending[uid] = (now + self.settle_s, transition)

    def forget(self, pod: dict) -> None:
        uid = (pod.get("metadata") or {}).get("uid")
        self.pending.pop(uid, None)
        self.seen.pop(uid, None)

    def relisted(self, uids: set[str]) -> None:
        """After a re-list: pods that are gone were deleted while we were not watching."""
        for uid in set(self.seen) - uids:
            self.seen.pop(uid, None)
            self.pending.pop(uid, None)

    def due(self, now: float) -> list[ReadyTransition]:
        ready = [(uid, transition) for uid, (at, transition) in self.pending.items() if at <= now]
        for uid, _ in ready:
            del self.pending[uid]
        return [transition for _, transition in ready]


@dataclass(frozen=True)
class PodTarget:
    """What a Ready pod's warmup warms: one replica of a catalog endpoint, or a worker."""

    endpoint: str | None = None
    worker_name: str | None = None  # e.g. "gpu0@{pod}"
    port: int | None = None
    port_name: str | None = None
    templates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.endpoint is None) == (self.worker_name is None):
            raise ConfigError("give --endpoint (pods are model servers) or --worker-name (pods are preheat workers)")
        if self.worker_name is not None and "{pod}" not in self.worker_name:
            raise ConfigError(f"--worker-name {self.worker_name!r} must contain {{pod}}, e.g. gpu0@{{pod}}")

    def replica(self, transition: ReadyTransition) -> str:
        """host:port of the pod's server: --port, else the port named --port-name, else its first."""
        if not transition.ip:
            raise ConfigError(f"pod {transition.pod} is Ready but has no IP")
        port = self.port
        if port is None and self.port_name:
            port = next((number for name, number in transition.ports if name == self.port_name), None)
        if port is None and transition.ports:
            port = transition.ports[0][1]
        if port is None:
            raise ConfigError(f"pod {transition.pod} declares no container port; give --port")
        return f"{transition.ip}:{port}"


def send_warmup(target: PodTarget, transition: ReadyTransition) -> str | None:
    """Dispatch the transition's warmup; its run id, or None when it could not be sent."""
    from preheat.dispatch import dispatch_endpoint_warmup, dispatch_warmup

    common = {
        "templates": list(target.templates) or None,
        "trigger": TriggerKind.pod_event,
        "requested_by": "watch-pods",
        "trigger_key": transition.trigger_key,
    }
    try:
        if target.endpoint:
            replica = target.replica(transition)
            dispatched = dispatch_endpoint_warmup(
                [target.endpoint], replica=replica, detail={**transition.detail(), "replica": replica}, **common
            )
        else:
            worker = target.worker_name.format(pod=transition.pod)
            dispatched = dispatch_warmup(workers=[worker], detail={**transition.detail(), "worker": worker}, **common)
    except PreheatError as exc:
        log.warning("pod %s/%s is Ready but was not warmed: %s", transition.namespace, transition.pod, exc)
        return None
    log.info(
        "pod %s/%s Ready since %s: run %s%s",
        transition.namespace,
        transition.pod,
        transition.ready_since,
        dispatched.run_id.hex[:8],
        " (sent before)" if dispatched.duplicate else "",
    )
    return str(dispatched.run_id)


class Gone(Exception):
    """The resourceVersion we watch from was compacted away (HTTP 410): list again."""


@dataclass(frozen=True)
class _Retry:
    transition: ReadyTransition
    first_at: float
    next_at: float
    backoff: float


# The broker or the database is away: worth retrying (the outbox's definition for the database).
SERVICES_AWAY = (BrokerError, *DATABASE_AWAY, ConnectionError, TimeoutError)


class PodWatcher:
    """List, then watch; re-watch on a dropped connection, re-list on 410 Gone or when one
    resourceVersion keeps failing. `namespace` None watches every namespace."""

    def __init__(
        self,
        api,
        namespace: str | None,
        selector: str | None,
        target: PodTarget,
        *,
        settle_s: float = 5.0,
        watch_timeout_s: int = 300,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        healthy_after_s: float = 30.0,
        relist_after_failures: int = 3,
        retry_for_s: float = 300.0,
        send=send_warmup,
    ) -> None:
        self.api = api  # kubernetes.client.CoreV1Api
        self.namespace, self.selector, self.target = namespace, selector, target
        self.tracker = ReadyTracker(settle_s=settle_s)
        self.watch_timeout_s, self.retry_for_s = watch_timeout_s, retry_for_s
        self.min_backoff_s, self.max_backoff_s, self.healthy_after_s = min_backoff_s, max_backoff_s, healthy_after_s
        self.relist_after_failures = relist_after_failures
        self.send = send
        self.resource_version: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._response = None
        self.relists = 0
        self.skipped = 0  # objects that were not valid pods

    @property
    def where(self) -> str:
        return self.namespace or "all namespaces"

    # The watch thread --------------------------------------------------------------

    def run(self) -> None:
        sender = threading.Thread(target=self._send_due, name="preheat-pod-warmups", daemon=True)
        sender.start()
        backoff, failures = self.min_backoff_s, 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if self.resource_version is None:
                    self._list()
                self._watch_once()
                backoff, failures = self.min_backoff_s, 0
            except Gone:
                log.info("resourceVersion %s is gone (410): listing again", self.resource_version)
                self.resource_version, failures = None, 0
            except Exception as exc:  # dropped connection, API server restarting, 5xx
                if self._stop.is_set():
                    break
                if time.monotonic() - started >= self.healthy_after_s:
                    backoff, failures = self.min_backoff_s, 0  # it was a healthy watch, cut: not a streak
                failures += 1
                if failures >= self.relist_after_failures and self.resource_version is not None:
                    log.warning(
                        "pod watch failed %d times in a row at resourceVersion %s (%s): listing again",
                        failures,
                        self.resource_version,
                        _reason(exc),
                    )
                    self.resource_version, failures = None, 0
                wait = random.uniform(backoff / 2, backoff)  # jittered: a fleet of watchers does not reconnect at once
                log.warning(
                    "pod watch interrupted (%s); watching again from %s in %.1f s",
                    _reason(exc),
                    self.resource_version,
                    wait,
                )
                self._stop.wait(wait)
                backoff = min(backoff * 2, self.max_backoff_s)
        sender.join(timeout=5)

    def _pods(self, **kwargs):
        """The list (or, with watch=True, the watch) call for this watcher's scope, raw."""
        if self.selector:
            kwargs["label_selector"] = self.selector
        if self.namespace is None:
            return self.api.list_pod_for_all_namespaces(_preload_content=False, **kwargs)
        return self.api.list_namespaced_pod(self.namespace, _preload_content=False, **kwargs)

    def _list(self) -> None:
        # Raw JSON: the same dicts the watch gives, never the client's models.
        body = _json(self._pods())
        items = body.get("items") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise ValueError("the pod list has no items")
        now, uids = time.monotonic(), set()
        with self._lock:
            for pod in items:
                if isinstance(pod, dict) and isinstance(pod.get("metadata"), dict) and self.namespace:
                    pod["metadata"].setdefault("namespace", self.namespace)
                if self._skip_malformed(pod, "listed"):
                    continue
                uids.add(pod["metadata"]["uid"])
                self.tracker.observe(pod, now)
            self.tracker.relisted(uids)
        self.resource_version = body["metadata"]["resourceVersion"]
        self.relists += 1
        log.info(
            "listed %d pod(s) in %s (%s) at resourceVersion %s",
            len(uids),
            self.where,
            self.selector or "all",
            self.resource_version,
        )

    def _skip_malformed(self, pod, how: str) -> bool:
        problem = pod_problem(pod)
        if problem is None:
            return False
        self.skipped += 1
        log.warning("skipping %s pod %s: %s", how, describe_pod(pod), problem)
        return True

    def _watch_once(self) -> None:
        from kubernetes.client.exceptions import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        try:
            self._response = self._pods(
                watch=True,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout_s,
            )
        except ApiException as exc:
            if exc.status == 410:
                raise Gone() from exc
            raise
        try:
            for line in iter_resp_lines(self._response):
                self._on_line(line)
                if self._stop.is_set():
                    break
        finally:
            self._response.close()
            self._response.release_conn()

    def _on_line(self, line) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            log.warning("skipping a watch event that is not JSON: %.80r", line)
            return
        if not isinstance(event, dict):
            log.warning("skipping a watch event that is not an object: %.80r", line)
            return
        self._on_event(event.get("type"), event.get("object"))

    def _on_event(self, kind, pod) -> None:
        if kind == "ERROR":
            code = pod.get("code") if isinstance(pod, dict) else None
            if code == 410:
                raise Gone()
            raise WatchError(f"the API server ended the watch: {pod.get('message') if isinstance(pod, dict) else pod}")
        metadata = pod.get("metadata") if isinstance(pod, dict) else None
        version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
        # Past this event, whatever it holds: a bad object must not be replayed for ever.
        self.resource_version = version if isinstance(version, str) and version else self.resource_version
        if kind == "BOOKMARK" or kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        if self._skip_malformed(pod, kind.lower()):
            return
        with self._lock:
            if kind == "DELETED":
                self.tracker.forget(pod)
            else:
                self.tracker.observe(pod, time.monotonic())

    # The sending thread --------------------------------------------------------------

    def _send_due(self) -> None:
        """Send transitions once settled, off the watch thread (a slow broker never stalls the
        watch). One the broker or database could not take is retried, with backoff, for
        `retry_for_s`: a pod that turned Ready during a Redis restart is still warmed."""
        retries: dict[str, _Retry] = {}
        while not self._stop.wait(0.1):
            now = time.monotonic()
            with self._lock:
                due = self.tracker.due(now)
            due += [retry.transition for retry in retries.values() if retry.next_at <= now]
            for transition in due:
                try:
                    self.send(self.target, transition)
                    retries.pop(transition.trigger_key, None)
                except SERVICES_AWAY as exc:
                    self._retry_later(retries, transition, now, exc)
                except Exception:
                    retries.pop(transition.trigger_key, None)
                    log.exception("could not warm pod %s/%s", transition.namespace, transition.pod)

    def _retry_later(self, retries: dict[str, _Retry], transition: ReadyTransition, now: float, exc: Exception) -> None:
        earlier = retries.get(transition.trigger_key)
        first_at, backoff = (earlier.first_at, min(earlier.backoff * 2, self.max_backoff_s)) if earlier else (now, 1.0)
        where = f"{transition.namespace}/{transition.pod}"
        if now - first_at > self.retry_for_s:
            retries.pop(transition.trigger_key, None)
            log.error(
                "pod %s is Ready but was not warmed: services away for %.0f s (%s)", where, now - first_at, _reason(exc)
            )
            return
        retries[transition.trigger_key] = _Retry(transition, first_at, now + backoff, backoff)
        log.warning(
            "pod %s is Ready; its warmup could not be sent (%s); retrying in %.0f s", where, _reason(exc), backoff
        )

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            # Shut the socket down, which wakes the watch thread's blocked read; close()
            # from here would wait on the lock that read holds.
            with contextlib.suppress(OSError, AttributeError):
                response.shutdown()


class WatchError(Exception):
    """The API server ended a watch with an error event other than 410."""


class PodWatchers:
    """Several namespaces' watchers, run and stopped together (`--namespace` repeated)."""

    def __init__(self, watchers: list[PodWatcher]) -> None:
        self.watchers = watchers

    def run(self) -> None:
        threads = [
            threading.Thread(target=w.run, name=f"preheat-watch-{w.where}", daemon=True) for w in self.watchers[1:]
        ]
        for thread in threads:
            thread.start()
        self.watchers[0].run()
        for thread in threads:
            thread.join(timeout=10)

    def stop(self) -> None:
        for watcher in self.watchers:
            watcher.stop()


def _json(response) -> dict:
    import json

    try:
        return json.loads(response.data)
    finally:
        response.release_conn()


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def kube_api(kubeconfig: str | None = None, context: str | None = None):
    """A CoreV1Api from the pod's service account (in a cluster) or a kubeconfig file."""
    from kubernetes import client, config

    if kubeconfig is None:
        try:
            config.load_incluster_config()
            return client.CoreV1Api()
        except config.ConfigException:
            pass
    try:
        config.load_kube_config(config_file=kubeconfig, context=context)
    except (config.ConfigException, OSError) as exc:
        raise ConfigError(
            f"no Kubernetes configuration: not in a cluster, and the kubeconfig "
            f"{kubeconfig or '~/.kube/config'} cannot be used ({exc})"
        ) from None
    return client.CoreV1Api()
