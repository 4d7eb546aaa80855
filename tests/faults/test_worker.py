"""A worker's own faults: a long prompt verified warm on a healthy worker, and out of memory
during a prefill recorded while the worker goes on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from preheat.core import processes
from tests.faults.common import HANDBOOK, WORKER

pytestmark = pytest.mark.slow


def test_a_long_template_is_warm_on_a_healthy_worker(services_stack, tiny_model, tmp_path):
    """A ~3,000-token template on a healthy, idle worker is `warm` and `preheat warm --wait`
    exits 0 (it came out `degraded` every time, held to the no-system-prompt TTFT: attention
    over 3,000 cached tokens is real work, not coldness). That a worker slowed since its best
    is `degraded` is tested with exact numbers in tests/workers/test_warmup.py: end to end,
    a throttled worker's verdict moved with whatever else the 2-core machine ran."""
    from tests.conftest import write_catalog

    stack = services_stack
    (stack.catalog.parent / "handbook.txt").write_text(HANDBOOK)
    handbook = '\n[templates.handbook]\nmodel = "tiny"\nsystem_prompt_file = "handbook.txt"\n'
    write_catalog(stack.catalog.parent, tiny_model, handbook)
    # Factor 8, not production's 1.5: on a quiet machine a healthy warm probe is within 1.2x
    # of its fastest run, but three test processes on two cores were seen to make it 2.5x.
    env = {**stack.env, "PREHEAT_WARM_FACTOR": "8", "PREHEAT_PROBE_REPEATS": "3"}
    worker = processes.start_worker(WORKER, env, tmp_path / "logs", cwd=stack.home)
    with processes.running(worker):
        processes.wait_for_log(worker, f"{WORKER} ready.", 90)
        # Up to three warmups: a neighbour test's burst on the shared cores can make one
        # probe run 30x its fastest (seen in CI); on an idle machine the first is warm.
        for _ in range(3):
            healthy = stack.cli("warm", "--template", "handbook", "--wait", "--json")
            [job] = json.loads(healthy.stdout)["jobs"]
            assert job["cached_tokens"] > 2500 and job["status"] in ("warm", "degraded"), job
            if job["status"] == "warm":
                break
            assert "factor" in job["error"], job  # only timing may stand in its way
    assert healthy.returncode == 0 and job["status"] == "warm", healthy.stdout + healthy.stderr


# Out of memory -------------------------------------------------------------------------


def _vm_data_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmData:\s+(\d+) kB", status).group(1)) * 1024


def test_out_of_memory_during_prefill_is_recorded_and_the_worker_goes_on(embedded_stack, tiny_model, tmp_path):
    """A real allocator failure: the worker's data segment is capped (RLIMIT_DATA, what a
    container memory limit does to malloc) a little above what it uses, and a template's
    system prompt grows to thousands of tokens, whose prefill needs more than that."""
    import resource

    from tests.conftest import write_catalog

    stack = embedded_stack
    prompt = stack.catalog.parent / "handbook.txt"
    prompt.write_text("You answer questions about the parcel handbook.")
    write_catalog(
        stack.catalog.parent,
        tiny_model,
        '\n[templates.handbook]\nmodel = "tiny"\nsystem_prompt_file = "handbook.txt"\n',
    )
    worker = processes.start_worker(WORKER, stack.env, tmp_path / "logs", cwd=stack.home)
    with processes.running(worker):
        processes.wait_for_log(worker, "Started consuming from preheat.infer.tiny", 90)
        prompt.write_text(HANDBOOK)  # edited: about 3,000 tokens now
        pid, unlimited = worker.popen.pid, resource.prlimit(worker.popen.pid, resource.RLIMIT_DATA)
        resource.prlimit(pid, resource.RLIMIT_DATA, (_vm_data_bytes(pid) + 48 * 2**20, unlimited[1]))

        capped = stack.cli("warm", "-t", "handbook", "-t", "support", "--wait", "--json", "--timeout", "120")
        assert capped.returncode == 1, capped.stderr
        jobs = {job["template"]: job for job in json.loads(capped.stdout)["jobs"]}
        assert jobs["handbook"]["status"] == "failed"
        assert "out of memory on cpu while running" in jobs["handbook"]["error"]
        assert "can't allocate memory" in jobs["handbook"]["error"]
        assert jobs["support"]["status"] == "warm"  # the other template, same task, after the failure

        # Still up, under the same cap: it answers a request, and says what is not ready.
        answered = stack.cli("infer", "support", "Where is my parcel?", "--max-tokens", "2", "--json")
        assert answered.returncode == 0, answered.stderr
        assert json.loads(answered.stdout)["cached_tokens"] > 0
        processes.poll(
            lambda: "out of memory" in " ".join(_worker_json(stack)["reasons"]),
            30,
            what="the worker's readiness naming the failed template",
        )

        # Memory back: the same warmup succeeds on the same process.
        resource.prlimit(pid, resource.RLIMIT_DATA, unlimited)
        recovered = stack.cli("warm", "-t", "handbook", "--wait", "--json", "--timeout", "120")
        assert recovered.returncode == 0, recovered.stdout + recovered.stderr
        assert json.loads(recovered.stdout)["jobs"][0]["cached_tokens"] > 2000
        assert worker.alive()
        assert _worker_json(stack)["reasons"] == []


def _worker_json(stack) -> dict:
    [worker] = json.loads(stack.cli("workers", "--json").stdout)
    return worker
