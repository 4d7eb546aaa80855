"""`preheat watch-pods`: a pod that becomes Ready gets exactly one warmup (the watch that sees
it is schedules/podwatch.py).

A transition is a pod's Ready condition turning True, or a pod first seen Ready. It is
identified by the pod's uid and the condition's lastTransitionTime, which every later
event of the same transition repeats: a storm of MODIFIED events, a re-list after a
410, or a restarted watcher (the run's trigger key is unique) yield no second warmup.
Without a lastTransitionTime the key is the latest container start (the containers'
`state.running.startedAt`), else the pod's `startTime`, else the pod alone: never the
resourceVersion, which every unrelated update (a label, a status tick) changes. Without
lastTransitionTime a readiness flap with no container restart is therefore not warmed
again; with it, each flap is a transition. A pod that is not a valid pod (a condition that
is not an object, a Ready condition without a status, no uid) is named with its fault.
A transition waits `settle_s` before it is sent (a new server often needs a moment after
its probe first passes); if the pod turns unready or is deleted meanwhile it is dropped,
and if it flaps back to Ready, the newer transition replaces it: one warmup.

What the warmup targets is the pod's IP and port: a catalog endpoint pointed at that one
replica (vLLM, `preheat serve`, …) or, for preheat GPU worker pods, that worker's own
queue (its nodename from a template such as "gpu0@{pod}", as the StatefulSet names it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from preheat.core.errors import ConfigError, PreheatError
from preheat.history.models import TriggerKind

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
    from preheat.fleet.dispatch import dispatch_endpoint_warmup, dispatch_warmup

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
