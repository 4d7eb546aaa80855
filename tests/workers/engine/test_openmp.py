"""Threads other than the scheduler's give their OpenMP team back (workers/engine/openmp.py):
a second team left alive stops libgomp's spinning, and every parallel region of the
scheduler's steps then waits for its threads to wake (measured: a 16-row step 49 → 131 ms)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from preheat.workers.engine.openmp import release_team, team_released


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(below: int, timeout_s: float = 5.0) -> int:
    """The process's thread count once it is below `below` (threads leave asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (count := _threads()) >= below and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


@pytest.fixture(autouse=True)
def _parallel():
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs one thread here: there is no team to give back")


def _steady(timeout_s: float = 5.0) -> int:
    """The process's thread count once it stops changing: a team an earlier test gave back may
    still be leaving, and counted before the work it would hide the work's own team."""
    deadline, last = time.monotonic() + timeout_s, _threads()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if (now := _threads()) == last:
            break
        last = now
    return last


def _on_a_living_thread(work) -> dict:
    """`work(counts)` on a new thread that is still alive when the counts are taken."""
    _steady()
    counts: dict = {}
    finished, leave = threading.Event(), threading.Event()

    def run():
        try:
            work(counts)
        finally:
            finished.set()
            leave.wait(30)

    thread = threading.Thread(target=run)
    thread.start()
    finished.wait(300)
    counts["after"] = _settled(counts["working"])
    leave.set()
    thread.join()
    return counts


def test_a_thread_that_ran_parallel_torch_work_gives_its_team_back():
    def work(counts):
        counts["before"] = _threads()
        torch.ones(8_000_000).mul_(2)  # large enough to run in parallel: this thread gets a team
        counts["working"] = _threads()
        release_team()

    counts = _on_a_living_thread(work)
    assert counts["working"] > counts["before"]  # the team's threads
    assert counts["after"] == counts["before"]  # gone, while the thread lives on


def test_the_team_is_given_back_when_the_work_raises():
    @team_released()
    def fails():
        torch.ones(8_000_000).mul_(2)
        raise ValueError("the work's own error")

    def work(counts):
        counts["before"] = _threads()
        with pytest.raises(ValueError):
            torch.ones(8_000_000).mul_(2)
            counts["working"] = _threads()
            fails()

    counts = _on_a_living_thread(work)
    assert counts["working"] > counts["before"] and counts["after"] == counts["before"]


def test_a_model_loaded_on_a_thread_that_lives_on_leaves_no_team_behind(tiny_model):
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    def work(counts):
        counts["before"] = _threads()
        torch.ones(8_000_000).mul_(2)  # a team before the load too: the load gives it back
        counts["working"] = _threads()
        ResidentModels("cpu", dtype_preference="float32").ensure(ModelSource("m", str(tiny_model)))

    counts = _on_a_living_thread(work)
    assert counts["after"] == counts["before"]


@pytest.mark.parametrize("environment,expected", [({}, "1000"), ({"GOMP_SPINCOUNT": "250"}, "250")])
def test_the_worker_sets_the_threads_spin_before_torch_loads_openmp_and_an_operators_value_wins(environment, expected):
    """preheat.workers sets GOMP_SPINCOUNT (1,000: GNU's 300,000 fights a neighbour's load, and
    10,000 failed the warm verdicts beside one on a Zen 4), before torch is imported: libgomp
    reads it once, when it is loaded."""
    import subprocess
    import sys

    from tests.conftest import REPO

    probe = "import preheat.workers, sys, os; print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)"
    env = {key: value for key, value in os.environ.items() if key != "GOMP_SPINCOUNT"} | environment
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [expected, "False"]
