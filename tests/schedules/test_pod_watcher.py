"""The pod watcher against the project's local API server, with the real `kubernetes` client:
malformed objects on the watch and list paths, transition keys without lastTransitionTime,
reconnects after healthy watches, several namespaces. The watcher runs in this process and
records what it would send; tests/schedules/test_pods.py runs the whole thing as processes."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from preheat.core import processes
from preheat.schedules.pods import PodTarget, transition_of
from preheat.schedules.podwatch import PodWatcher, PodWatchers, kube_api
from tests.schedules.fake_kube import FakeKube, pod

T1 = "2026-11-30T08:00:00Z"


@pytest.fixture
def kube():
    server = FakeKube().start()
    yield server
    server.stop()


class Recorder:
    def __init__(self) -> None:
        self.sent = []

    def __call__(self, target, transition) -> None:
        self.sent.append(transition)

    def pods(self) -> list[str]:
        return [t.pod for t in self.sent]


def start_watcher(kube, tmp_path, namespaces=("serving",), **options) -> tuple[PodWatchers, Recorder]:
    recorder = Recorder()
    api = kube_api(kube.kubeconfig(tmp_path / "kubeconfig"))
    options.setdefault("settle_s", 0)
    watchers = PodWatchers(
        [PodWatcher(api, ns, None, PodTarget(endpoint="vllm"), send=recorder, **options) for ns in namespaces]
    )
    threading.Thread(target=watchers.run, daemon=True).start()
    processes.poll(lambda: len(kube.watches()) >= len(namespaces), 10, what="the watch")
    return watchers, recorder


def bad_pods() -> list[tuple[str, dict]]:
    no_status = pod("no-status", "uid-ns", ready=True, since=T1)
    del no_status["status"]["conditions"][0]["status"]
    not_an_object = pod("not-an-object", "uid-no", ready=True, since=T1)
    not_an_object["status"]["conditions"] = ["Ready", {"type": "Ready", "status": "True"}]
    no_uid = pod("no-uid", "", ready=True, since=T1)
    return [
        ("(Ready) has no valid status", no_status),
        ("conditions[0] is not an object", not_an_object),
        ("metadata.uid is missing", no_uid),
    ]


def test_a_malformed_event_is_skipped_with_a_line_and_a_later_ready_pod_is_warmed(kube, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="preheat.schedules")
    watchers, recorder = start_watcher(kube, tmp_path)
    try:
        for _, bad in bad_pods():
            kube.inject("MODIFIED", bad)
        kube.inject("MODIFIED", "not a pod at all")
        kube.apply(pod("good", "uid-g", ready=True, since=T1))
        processes.poll(lambda: recorder.pods() == ["good"], 10, what="the good pod's warmup")
    finally:
        watchers.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    for fault, bad in bad_pods():
        assert any(fault in line and bad["metadata"]["name"] in line for line in lines), (fault, lines)
    assert any("serving/no-status (uid uid-ns)" in line for line in lines)
    assert len(kube.lists()) == 1 and len(kube.watches()) == 1  # never replayed, never re-listed
    assert watchers.watchers[0].skipped == 4


def test_a_malformed_listed_pod_is_skipped_and_the_watch_starts(kube, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="preheat.schedules")
    for _, bad in bad_pods():
        kube.apply(bad)
    kube.apply(pod("listed", "uid-l", ready=True, since=T1))
    watchers, recorder = start_watcher(kube, tmp_path)
    try:
        kube.apply(pod("later", "uid-later", ready=True, since=T1))
        processes.poll(lambda: recorder.pods() == ["listed", "later"], 10, what="both good pods")
    finally:
        watchers.stop()
    assert len(kube.lists()) == 1
    assert sum(r.getMessage().startswith("skipping listed pod") for r in caplog.records) == 3


def test_an_error_that_repeats_at_one_version_ends_in_a_fresh_list(kube, tmp_path):
    watchers, recorder = start_watcher(kube, tmp_path, min_backoff_s=0.05, relist_after_failures=3)
    try:
        kube.inject("ERROR", {"kind": "Status", "code": 500, "message": "etcdserver: request timed out"})
        processes.poll(lambda: len(kube.lists()) == 2, 15, what="a fresh list after repeated failures")
        # The fresh list moved past the bad event (the server keeps sending it from older versions).
        kube.apply(pod("after", "uid-a", ready=True, since=T1))
        processes.poll(lambda: recorder.pods() == ["after"], 10, what="the pod after the error")
    finally:
        watchers.stop()


def ready_without_transition_time(note: str = "", started: str = "2026-11-30T07:59:00Z") -> dict:
    found = pod("p", "uid-p", ready=True, since=T1, note=note)
    del found["status"]["conditions"][0]["lastTransitionTime"]
    found["status"]["containerStatuses"] = [{"name": "server", "state": {"running": {"startedAt": started}}}]
    return found


def test_without_last_transition_time_a_pod_updated_while_ready_is_one_transition(kube, tmp_path):
    kube.apply(ready_without_transition_time())
    watchers, recorder = start_watcher(kube, tmp_path)
    try:
        processes.poll(lambda: recorder.pods() == ["p"], 10, what="the first warmup")
        for note in ("a", "b", "c"):  # an annotation, twice more: each a new resourceVersion
            kube.apply(ready_without_transition_time(note))
        kube.bookmark()
        time.sleep(0.5)
    finally:
        watchers.stop()
    # A restarted watcher lists the pod again: the same key, so dispatch's unique trigger key
    # keeps it to one run (tested in test_pods); here the key itself is what must not move.
    restarted, again = start_watcher(kube, tmp_path)
    processes.poll(lambda: again.pods() == ["p"], 10, what="the restarted watcher's view")
    restarted.stop()
    assert len(recorder.sent) == 1
    assert recorder.sent[0].trigger_key == again.sent[0].trigger_key == "pod:uid-p:started:2026-11-30T07:59:00Z"
    # A container restart is a new transition.
    assert transition_of(ready_without_transition_time(started="2026-11-30T09:00:00Z")).trigger_key != (
        recorder.sent[0].trigger_key
    )


def test_reconnects_stay_fast_when_every_cut_follows_a_healthy_watch(kube, tmp_path):
    watchers, _ = start_watcher(kube, tmp_path, min_backoff_s=0.2, max_backoff_s=30, healthy_after_s=0.5)
    delays = []
    try:
        for cut in range(6):
            time.sleep(0.7)  # the watch was healthy for longer than healthy_after_s
            before, cut_at = len(kube.watches()), time.monotonic()
            kube.drop()
            processes.poll(lambda n=before: len(kube.watches()) > n, 10, what=f"the watch after cut {cut + 1}")
            delays.append(kube.watches()[-1]["at"] - cut_at)
    finally:
        watchers.stop()
    # Without the reset the waits would have doubled each time: 0.2 … 6.4 s.
    assert max(delays) < 1.0, delays
    assert len(kube.lists()) == 1


def test_two_namespaces_each_watched_and_every_namespace_at_once(kube, tmp_path):
    for namespace in ("serving", "batch", "elsewhere"):
        kube.apply(pod(f"in-{namespace}", f"uid-{namespace}", ready=True, since=T1, namespace=namespace))
    watchers, recorder = start_watcher(kube, tmp_path, namespaces=("serving", "batch"))
    try:
        processes.poll(lambda: sorted(recorder.pods()) == ["in-batch", "in-serving"], 10, what="two namespaces")
        kube.apply(pod("new-batch", "uid-nb", ready=True, since=T1, namespace="batch"))
        processes.poll(lambda: "new-batch" in recorder.pods(), 10, what="a new pod in batch")
    finally:
        watchers.stop()
    assert {t.pod: t.namespace for t in recorder.sent} == {
        "in-serving": "serving",
        "in-batch": "batch",
        "new-batch": "batch",
    }
    assert {t.pod: t.detail()["namespace"] for t in recorder.sent}["new-batch"] == "batch"
    everywhere, seen = start_watcher(kube, tmp_path, namespaces=(None,))
    try:
        processes.poll(lambda: len(seen.pods()) == 4, 10, what="every namespace")
    finally:
        everywhere.stop()
    assert {t.namespace for t in seen.sent} == {"serving", "batch", "elsewhere"}
    assert kube.watches()[-1]["namespace"] is None
