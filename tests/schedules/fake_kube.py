"""A local Kubernetes API server that speaks the pods list / watch protocol, for the watcher's
tests: list with a resourceVersion, watch as chunked JSON lines from a resourceVersion, label
selectors, BOOKMARK events, 410 Gone for a compacted resourceVersion, bearer-token auth, and
connections it can drop mid-stream. The real `kubernetes` client talks to it over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from dataclasses import dataclass, field

import tornado.httpserver
import tornado.iostream
import tornado.netutil
import tornado.web

TOKEN = "watcher-token"


def pod(
    name: str,
    uid: str,
    *,
    ready: bool,
    since: str,
    ip: str = "127.0.0.1",
    port: int = 8000,
    labels: dict | None = None,
    namespace: str = "serving",
    note: str = "",
) -> dict:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "labels": labels or {"app": "vllm"},
            "annotations": {"note": note},
        },
        "spec": {
            "containers": [
                {
                    "name": "server",
                    "image": "vllm/vllm-openai",
                    "ports": [{"name": "metrics", "containerPort": 9090}, {"name": "http", "containerPort": port}],
                }
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": since}],
        },
    }


@dataclass
class FakeKube:
    namespace: str = "serving"
    resource_version: int = 1000
    compacted_below: int = 0
    pods: dict[str, dict] = field(default_factory=dict)
    events: list[tuple[int, str, dict]] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)  # what the watcher asked: list/watch and from where
    drops: int = 0

    def start(self) -> FakeKube:
        ready = threading.Event()

        def serve() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.changed = asyncio.Condition()
            app = tornado.web.Application(
                [
                    (r"/api/v1/namespaces/([^/]+)/pods", PodsHandler, {"kube": self}),
                    (r"/api/v1/pods()", PodsHandler, {"kube": self}),  # every namespace
                ]
            )
            sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
            self.port = sockets[0].getsockname()[1]
            self.server = tornado.httpserver.HTTPServer(app)
            self.server.add_sockets(sockets)
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path) -> str:
        path.write_text(
            json.dumps(
                {  # YAML is a superset of JSON
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "watcher", "user": {"token": TOKEN}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "watcher"}}],
                }
            )
        )
        return str(path)

    # What the test does to the cluster (from its own thread) ----------------------------

    def _on_loop(self, change) -> None:
        async def apply() -> None:
            change()
            async with self.changed:
                self.changed.notify_all()

        asyncio.run_coroutine_threadsafe(apply(), self.loop).result(5)

    def _record(self, kind: str, obj: dict) -> None:
        self.resource_version += 1
        obj = copy.deepcopy(obj)
        if kind == "ERROR" or not isinstance(obj, dict):  # a Status, or garbage: no resourceVersion
            self.events.append((self.resource_version, kind, obj))
            return
        obj["metadata"]["resourceVersion"] = str(self.resource_version)
        if kind == "DELETED":
            self.pods.pop(obj["metadata"]["name"], None)
        elif kind != "BOOKMARK":
            self.pods[obj["metadata"]["name"]] = obj
        self.events.append((self.resource_version, kind, obj))

    def apply(self, obj: dict) -> None:
        """Create or update a pod (ADDED or MODIFIED)."""
        self._on_loop(lambda: self._record("MODIFIED" if obj["metadata"]["name"] in self.pods else "ADDED", obj))

    def inject(self, kind: str, obj) -> None:
        """An event as the server sends it, whatever it holds (a malformed pod, an ERROR)."""
        self._on_loop(lambda: self._record(kind, obj))

    def delete(self, name: str) -> None:
        self._on_loop(lambda: self._record("DELETED", self.pods[name]))

    def bookmark(self) -> int:
        self._on_loop(lambda: self._record("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {}}))
        return self.resource_version

    def drop(self) -> None:
        """Cut every open watch mid-stream (no final chunk), as a load balancer or a restart does."""

        def cut() -> None:
            self.drops += 1

        self._on_loop(cut)

    def compact(self) -> None:
        """Forget history up to now (etcd compaction): a watch from an older version gets 410."""

        def forget() -> None:
            self.compacted_below = self.resource_version + 1
            self.drops += 1  # open watches end; their re-watch meets the 410

        self._on_loop(forget)

    def watches(self) -> list[dict]:
        return [r for r in self.requests if r["watch"]]

    def lists(self) -> list[dict]:
        return [r for r in self.requests if not r["watch"]]


def _in(obj: dict, namespace: str) -> bool:
    return not namespace or obj["metadata"].get("namespace") == namespace


def _matches(obj: dict, selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(key) == value for key, value in (term.split("=", 1) for term in selector.split(",")))


class PodsHandler(tornado.web.RequestHandler):
    def initialize(self, kube: FakeKube) -> None:
        self.kube = kube

    def prepare(self) -> None:
        if self.request.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.set_status(401)
            self.finish({"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401})

    async def get(self, namespace: str) -> None:
        selector = self.get_argument("labelSelector", None)
        watching = self.get_argument("watch", "").lower() in ("true", "1")
        since = int(self.get_argument("resourceVersion", "0") or 0)
        self.kube.requests.append(
            {
                "watch": watching,
                "resourceVersion": since,
                "selector": selector,
                "bookmarks": self.get_argument("allowWatchBookmarks", ""),
                "namespace": namespace or None,
                "at": time.monotonic(),
            }
        )
        self.set_header("Content-Type", "application/json")
        if not watching:
            items = [p for p in self.kube.pods.values() if _matches(p, selector) and _in(p, namespace)]
            self.finish(
                {
                    "kind": "PodList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.kube.resource_version)},
                    "items": items,
                }
            )
            return
        if since < self.kube.compacted_below:
            self.finish(
                json.dumps(
                    {
                        "type": "ERROR",
                        "object": {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "metadata": {},
                            "status": "Failure",
                            "reason": "Expired",
                            "message": f"too old resource version: {since} ({self.kube.compacted_below})",
                            "code": 410,
                        },
                    }
                )
                + "\n"
            )
            return
        await self._stream(since, selector, namespace, float(self.get_argument("timeoutSeconds", "300")))

    async def _stream(self, since: int, selector: str | None, namespace: str, timeout_s: float) -> None:
        drops, deadline = self.kube.drops, time.monotonic() + timeout_s
        while True:
            for version, kind, obj in list(self.kube.events):
                everyone = kind in ("BOOKMARK", "ERROR") or not isinstance(obj, dict)
                if version > since and (everyone or (_matches(obj, selector) and _in(obj, namespace))):
                    self.write(json.dumps({"type": kind, "object": obj}) + "\n")
                    since = version
            try:
                await self.flush()
            except tornado.iostream.StreamClosedError:
                return  # the watcher closed it (stopping, or done)
            async with self.kube.changed:
                remaining = deadline - time.monotonic()
                if remaining > 0 and self.kube.drops == drops:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.kube.changed.wait(), min(remaining, 1.0))
            if self.kube.drops != drops:
                self.request.connection.stream.close()  # mid-stream: no terminating chunk
                return
            if time.monotonic() >= deadline:
                self.finish()
                return
