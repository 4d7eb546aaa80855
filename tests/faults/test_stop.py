"""Every stop completes, whatever one step raises: a prefix store that cannot be written at stop
(a folder that became a file; a full disk) neither aborts the shutdown nor leaves the worker a
target. The row is marked stopped, the pulse removed, and the router forgets the worker at
once; the CLI does not refuse to work over a setting only a worker uses."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from preheat.core import processes
from preheat.history.db import session_scope

pytestmark = pytest.mark.slow


def _row(nodename: str):
    from preheat.fleet import registry

    with session_scope() as session:
        return next((r for r in registry.workers(session) if r.nodename == nodename), None)


def _pulse(nodename: str):
    from preheat.core.settings import get_settings
    from preheat.fleet.liveness import pulses_for

    return pulses_for(get_settings()).read(nodename)


def _ask_with_a_new_system_prompt(stack_app, model: str, n: int):
    """A request whose system prompt is new: its prefix is computed and written to the store."""
    from preheat.fleet.routing import send_infer

    messages = [{"role": "system", "content": f"Be brief, {n}."}, {"role": "user", "content": "Hi"}]
    return send_infer(stack_app, {"model": model, "messages": messages, "max_tokens": 2})


@pytest.mark.parametrize("fault", ["folder-now-a-file", "disk-full"])
def test_a_prefix_store_that_fails_at_stop_does_not_stop_the_stop(services_stack, services_app, tmp_path, fault):
    nodename = f"w1@stop-{fault}"
    store = tmp_path / "prefixes"
    env = {**services_stack.env, "PREHEAT_PREFIX_STORE": str(store)}
    argv = processes.worker_command("--pool=threads", "-n", nodename, "--loglevel=INFO", "--without-gossip")
    if fault == "disk-full":  # every file the worker writes is cut at 64 KiB: writes fail with EFBIG
        argv = ["prlimit", f"--fsize={64 * 1024}", *argv]
    worker = processes.start("w1", argv, env, tmp_path / "logs", cwd=services_stack.home)
    with processes.running(worker):
        processes.wait_for_log(worker, "model tiny takes requests", 120)
        assert _pulse(nodename) is not None and _row(nodename).stopped_at is None
        if fault == "folder-now-a-file":
            shutil.rmtree(store)
            store.write_text("a file where the store was")
        pending = [_ask_with_a_new_system_prompt(services_app, "tiny", n) for n in range(3)]
        for call in pending:
            call.get(timeout=60)
        code = processes.stop(worker)
    assert code == 0, worker.log()[-3000:]
    log = worker.log()
    assert "not stored in" in log and "Traceback" not in log.split("worker: Warm shutdown")[-1]
    row = _row(nodename)
    assert row.stopped_at is not None and not row.ready  # marked stopped, whatever the store did
    assert _pulse(nodename) is None  # and no pulse says it lives
    # The next warmup dispatches to nobody (and no job is lost to a worker that is gone).
    done = services_stack.cli("warm", "--wait", "--json", "--timeout", "20")
    assert done.returncode == 3 and "no live preheat worker" in done.stderr, done.stdout + done.stderr


def test_a_worker_stopped_cleanly_is_routed_nothing_the_moment_it_stops(services_stack, services_app, tmp_path):
    from preheat.fleet.routing import send_infer

    nodes = ["w1@route-stop", "w2@route-stop"]
    workers = [processes.start_worker(n, services_stack.env, tmp_path / n, cwd=services_stack.home) for n in nodes]
    with processes.running(*workers):
        for worker in workers:
            processes.wait_for_log(worker, "model tiny takes requests", 120)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        first = send_infer(services_app, {"model": "tiny", "messages": messages, "max_tokens": 4})
        holder = first.get(timeout=60)["worker"]
        turn_two = [*messages, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
        processes.stop(workers[nodes.index(holder)])
        stopped_at = time.monotonic()
        second = send_infer(services_app, {"model": "tiny", "messages": turn_two, "max_tokens": 4})
        answer = second.get(timeout=60)
        assert time.monotonic() - stopped_at < 2.5  # no re-send after PREHEAT_ROUTE_TAKE_S (3 s)
        assert second.route.worker != holder and answer["worker"] != holder, second.route.reason
        assert not [route for route in second.routes if route.worker == holder]


def test_the_cli_does_not_refuse_to_work_over_a_setting_only_workers_use(embedded_stack, tmp_path):
    store = tmp_path / "store-file"
    store.write_text("not a folder")
    env = {**embedded_stack.env, "PREHEAT_PREFIX_STORE": str(store)}
    listed = embedded_stack.cli_env(env, "history", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    checked = embedded_stack.cli_env(env, "config", "check")
    assert checked.returncode == 2 and "PREHEAT_PREFIX_STORE" in checked.stderr  # the check names it
    served = processes.start_serve(env, tmp_path / "logs")
    assert served.popen.wait(60) == 2 and "invalid setting PREHEAT_PREFIX_STORE" in served.log()
