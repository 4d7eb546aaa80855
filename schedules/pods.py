"""`preheat watch-pods`: a pod that becomes Ready gets exactly one warmup.

With the official `kubernetes` client: list the pods (namespace, label selector), then
watch from the list's resourceVersion with bookmarks on. A dropped connection is watched
again from the last resourceVersion seen (an event's or a bookmark's), with backoff; a
410 Gone (that version is compacted away) starts over with a fresh list.

A transition is a pod's Ready condition turning True, or a pod first seen Ready. It is
identified by the pod's uid and the condition's lastTransitionTime, which every later
event of the same transition repeats: a storm of MODIFIED events, a re-list after a
410, or a restarted watcher (the run's trigger key is unique) yield no second warmup.
A transition waits `settle_s` before it is sent (a new server often needs a moment after
its probe first passes); if the pod turns unready or is deleted meanwhile it is dropped,
and if it flaps back to Ready, the newer transition replaces it: one warmup.

What the warmup targets is the pod's IP and port: a catalog endpoint pointed at that one
replica (vLLM, `preheat serve`, …) or, for preheat GPU worker pods, that worker's own
queue (its nodename from a template such as "gpu0@{pod}", as the StatefulSet names it).
"""

from __future__ import annotations

import logging
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
    ready_since: str  # the Ready condition's lastTransitionTime (or the resourceVersion seen)
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


def is_ready(pod: dict) -> tuple[bool, str | None]:
    """Whether the pod's Ready condition is True, and since when."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True", condition.get("lastTransitionTime")
    return False, None


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
        ready_since=since or f"rv{metadata.get('resourceVersion')}",
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
    """List, then watch; re-watch on a dropped connection, re-list on 410 Gone."""

    def __init__(
        self,
        api,
        namespace: str,
        selector: str | None,
        target: PodTarget,
        *,
        settle_s: float = 5.0,
        watch_timeout_s: int = 300,
        max_backoff_s: float = 30.0,
        retry_for_s: float = 300.0,
        send=send_warmup,
    ) -> None:
        self.api = api  # kubernetes.client.CoreV1Api
        self.namespace, self.selector, self.target = namespace, selector, target
        self.tracker = ReadyTracker(settle_s=settle_s)
        self.watch_timeout_s, self.max_backoff_s, self.retry_for_s = watch_timeout_s, max_backoff_s, retry_for_s
        self.send = send
        self.resource_version: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch = None
        self.relists = 0

    # The watch thread --------------------------------------------------------------

    def run(self) -> None:
        sender = threading.Thread(target=self._send_due, name="preheat-pod-warmups", daemon=True)
        sender.start()
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._list()
                self._watch_once()
                backoff = 0.5
            except Gone:
                log.info("resourceVersion %s is gone (410): listing again", self.resource_version)
                self.resource_version = None
            except Exception as exc:  # dropped connection, API server restarting, 5xx
                if self._stop.is_set():
                    break
                log.warning(
                    "pod watch interrupted (%s); watching again from %s in %.1f s",
                    _reason(exc),
                    self.resource_version,
                    backoff,
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
        sender.join(timeout=5)

    def _list(self) -> None:
        # Raw JSON: the same dicts the watch's raw_object gives, not the client's models.
        body = _json(self.api.list_namespaced_pod(self.namespace, label_selector=self.selector, _preload_content=False))
        now = time.monotonic()
        with self._lock:
            for pod in body.get("items") or []:
                pod.setdefault("metadata", {}).setdefault("namespace", self.namespace)
                self.tracker.observe(pod, now)
            self.tracker.relisted({(pod.get("metadata") or {}).get("uid") for pod in body.get("items") or []})
        self.resource_version = body["metadata"]["resourceVersion"]
        self.relists += 1
        log.info(
            "listed %d pod(s) in %s (%s) at resourceVersion %s",
            len(body.get("items") or []),
            self.namespace,
            self.selector or "all",
            self.resource_version,
        )

    def _watch_once(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        self._watch = watch.Watch()
        try:
            stream = self._watch.stream(
                self.api.list_namespaced_pod,
                self.namespace,
                label_selector=self.selector,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout_s,
            )
            for event in stream:
                self._on_event(event)
                if self._stop.is_set():
                    break
        except ApiException as exc:
            if exc.status == 410:
                raise Gone() from exc
            raise
        finally:
            self._watch.stop()

    def _on_event(self, event: dict) -> None:
        kind, pod = event.get("type"), event.get("raw_object") or {}
        version = (pod.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            self.resource_version = version or self.resource_version
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        with self._lock:
            if kind == "DELETED":
                self.tracker.forget(pod)
            else:
                self.tracker.observe(pod, time.monotonic())
        self.resource_version = version or self.resource_version

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
        if self._watch is not None:
            self._watch.stop()


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
