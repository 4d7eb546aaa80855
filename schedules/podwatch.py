"""`preheat watch-pods`: the watch itself (schedules/pods.py says what a transition is and
what it warms).

With the official `kubernetes` client: list the pods (namespace, label selector), then
watch from the list's resourceVersion with bookmarks on. A dropped connection is watched
again from the last resourceVersion seen (an event's or a bookmark's), with backoff; a
410 Gone (that version is compacted away) starts over with a fresh list. What arrives from
the API server is read as raw JSON, never through the client's typed models: an event or a
listed item that is not a valid pod is skipped with one log line naming the pod and the
fault, and the watch goes on from the version after it. A watch that fails again and again
at one resourceVersion is given up for a fresh list. Reconnects back off (jittered,
bounded), and the backoff starts over after a watch that stayed healthy for a while, so
periodic cuts by a load balancer keep reconnects fast.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from dataclasses import dataclass

from kombu.exceptions import OperationalError as BrokerError

from preheat.core.errors import ConfigError
from preheat.history.db import DATABASE_AWAY
from preheat.schedules.pods import PodTarget, ReadyTracker, ReadyTransition, describe_pod, pod_problem, send_warmup

log = logging.getLogger(__name__)


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
