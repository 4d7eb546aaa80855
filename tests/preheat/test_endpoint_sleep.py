"""Sleep and wake of a remote vLLM server, against the fake vLLM process (tests/fakes/vllm.py):
the real paths and parameters, warmth after a wake proven by the server's own evidence, a
server without dev mode in one line, a wake that never completes failed with its reason."""

import json
import re
import subprocess
import sys

import httpx
import pytest

from preheat.core import processes
from preheat.core.catalog import EndpointSpec, load_catalog
from preheat.endpoints.keepalive import keep_alive
from preheat.endpoints.pools import POOLS
from preheat.endpoints.sleep import sleep_endpoint, wake_and_prime, wake_endpoint
from preheat.endpoints.warmup import prefix_cache_counters
from tests.conftest import write_catalog


@pytest.fixture
def fake_vllm(tmp_path):
    """fake_vllm(*flags) -> base URL of a fake vLLM process (stopped at the end)."""
    started = []

    def start(*flags: str) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes.vllm", *flags], stdout=subprocess.PIPE, text=True, cwd=_repo()
        )
        started.append(proc)
        url = re.search(r"http://\S+", proc.stdout.readline()).group(0)
        processes.poll(lambda: httpx.get(f"{url}/health").status_code == 200, 10, what="fake vllm")
        return url

    yield start
    POOLS.close_all()
    for proc in started:
        proc.kill()
        proc.wait()


def _repo():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


def _catalog(tmp_path, tiny_model, url: str, sleep: str = "level = 1\nwake_timeout_s = 5"):
    extra = (
        f'\n[endpoints.vllm]\nbase_url = "{url}/v1"\nkind = "vllm"\nmodel = "fake-model"\ntemplates = ["support"]\n'
        f"\n[endpoints.vllm.sleep]\n{sleep}\n"
    )
    return load_catalog(write_catalog(tmp_path, tiny_model, extra))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_wake_primes_again_and_is_warm_only_on_the_servers_evidence(fake_vllm, tmp_path, tiny_model, level):
    url = fake_vllm("--dev-mode", "--enable-prompt-tokens-details")
    catalog = _catalog(tmp_path, tiny_model, url, f"level = {level}\nmode = 'wait'\nwake_timeout_s = 5")
    spec = catalog.endpoint("vllm")

    slept = sleep_endpoint("vllm", spec)
    assert (slept.status, slept.sleep_level, slept.error) == ("asleep", level, None) and slept.sleep_ms > 0
    assert httpx.get(f"{url}/fake/calls").json()["sleeps"] == [{"level": level, "mode": "wait"}]
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    assert sleep_endpoint("vllm", spec).status == "skipped"  # asleep already
    assert keep_alive("vllm", spec, catalog, None).skipped  # no prompt reaches a sleeping server

    woken, primed = wake_and_prime("vllm", spec, catalog, ["support"])
    assert (woken.status, woken.sleep_level, woken.error) == ("awake", level, None) and woken.wake_ms > 0
    [support] = primed
    assert support.status == "warm", support.error
    assert support.cached_tokens > 0  # the repeated prompt came from vLLM's prefix cache
    hits, queries = prefix_cache_counters("vllm", spec)
    assert 0 < hits < queries


def test_without_cached_tokens_the_prefix_cache_counters_are_the_evidence(fake_vllm, tmp_path, tiny_model):
    url = fake_vllm("--dev-mode")  # no --enable-prompt-tokens-details: usage has no cached_tokens
    catalog = _catalog(tmp_path, tiny_model, url)
    spec = catalog.endpoint("vllm")
    assert sleep_endpoint("vllm", spec).status == "asleep"
    woken, [support] = wake_and_prime("vllm", spec, catalog, ["support"])
    assert woken.status == "awake" and support.status == "warm" and support.cached_tokens is None


def test_a_server_without_dev_mode_is_one_line_and_a_wake_that_never_comes_fails(fake_vllm, tmp_path, tiny_model):
    url = fake_vllm()  # no dev mode: /sleep is 404
    catalog = _catalog(tmp_path, tiny_model, url)
    refused = sleep_endpoint("vllm", catalog.endpoint("vllm"))
    assert refused.status == "failed"
    assert refused.error == (
        "endpoint 'vllm': the server has no sleep mode (404 on /is_sleeping): start vLLM with "
        "VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode"
    )

    url = fake_vllm("--dev-mode", "--wake-never")
    catalog = _catalog(tmp_path, tiny_model, url, "wake_timeout_s = 0.5")
    spec = catalog.endpoint("vllm")
    assert sleep_endpoint("vllm", spec).status == "asleep"
    woken, [support] = wake_and_prime("vllm", spec, catalog, ["support"])
    assert woken.status == "failed" and woken.error == "endpoint 'vllm': still asleep 0.5 s after POST /wake_up"
    assert support.status == "failed" and "the wake failed" in support.error
    # Polled with backoff: 50, 100, 200 ms ... not every 50 ms (10 polls in 0.5 s).
    polls = httpx.get(f"{url.removesuffix('/v1')}/fake/calls").json()["is_sleeping_calls"]
    assert polls <= 8, polls


@pytest.mark.parametrize("metrics", ["missing", "garbage"])
def test_a_wake_falls_back_to_the_declared_level_when_metrics_are_unusable(fake_vllm, tmp_path, tiny_model, metrics):
    url = fake_vllm("--dev-mode", "--metrics", metrics)
    catalog = _catalog(tmp_path, tiny_model, url, "level = 2")
    spec = catalog.endpoint("vllm")
    assert sleep_endpoint("vllm", spec).status == "asleep"
    woken = wake_endpoint("vllm", spec)
    assert woken.status == "awake" and woken.sleep_level == 2, woken.error


def test_a_malformed_is_sleeping_names_the_endpoint_and_path(fake_vllm, tmp_path, tiny_model):
    url = fake_vllm("--dev-mode", "--is-sleeping-garbage")
    catalog = _catalog(tmp_path, tiny_model, url)
    for result in (sleep_endpoint("vllm", catalog.endpoint("vllm")), wake_endpoint("vllm", catalog.endpoint("vllm"))):
        assert result.status == "failed"
        assert result.error.startswith("endpoint 'vllm': GET /is_sleeping answered no JSON with is_sleeping"), result


def test_sleep_is_declared_only_for_vllm():
    with pytest.raises(ValueError, match="sleep is vLLM's sleep mode"):
        EndpointSpec(base_url="http://x/v1", kind="openai", sleep={"level": 1})
    with pytest.raises(ValueError):
        EndpointSpec(base_url="http://x/v1", kind="vllm", sleep={"level": 3})


@pytest.mark.slow
def test_preheat_sleep_and_wake_of_an_endpoint_through_a_worker_are_recorded(
    embedded_stack, fake_vllm, tmp_path, tiny_model
):
    url = fake_vllm("--dev-mode", "--enable-prompt-tokens-details")
    extra = (
        f'\n[endpoints.vllm]\nbase_url = "{url}/v1"\nkind = "vllm"\nmodel = "fake-model"\ntemplates = ["support"]\n'
        "\n[endpoints.vllm.sleep]\nlevel = 2\n"
    )
    write_catalog(embedded_stack.catalog.parent, tiny_model, extra)  # the stack's own catalog, with the endpoint
    cli = embedded_stack.cli
    worker = processes.start_worker("io@sleep-endpoint", embedded_stack.env, tmp_path / "logs", cwd=embedded_stack.home)
    with processes.running(worker):
        processes.wait_for_log(worker, "io@sleep-endpoint ready.")

        slept = cli("sleep", "--endpoint", "vllm", "--wait", "--json")
        assert slept.returncode == 0, slept.stderr + worker.log()[-3000:]
        run = json.loads(slept.stdout)
        assert run["action"] == "sleep" and [(j["template"], j["status"]) for j in run["jobs"]] == [("*", "asleep")]
        assert run["jobs"][0]["sleep_level"] == 2 and run["jobs"][0]["target_kind"] == "endpoint"

        woke = cli("wake", "--endpoint", "vllm", "--wait", "--json")
        assert woke.returncode == 0, woke.stderr + worker.log()[-3000:]
        rows = {job["template"]: job for job in json.loads(woke.stdout)["jobs"]}
        assert rows["*"]["status"] == "awake" and rows["*"]["wake_ms"] > 0
        assert rows["support"]["status"] == "warm" and rows["support"]["cached_tokens"] > 0

        refused = cli("sleep", "--endpoint", "vllm", "--worker", "w1")
        assert refused.returncode == 2 and "give --endpoint without --worker" in refused.stderr


@pytest.mark.slow
def test_a_day_in_minutes_the_endpoint_asleep_at_night_and_warm_for_the_morning_peak(
    embedded_stack, fake_vllm, tmp_path, tiny_model
):
    """Beat's own code fires each slot at its moment (a chosen clock); a real worker sends the
    sleep and the wake to the fake vLLM; the peak's first request finds its prefix cached."""
    import datetime as dt

    from preheat.celery.app import app, celery_config
    from preheat.core.settings import get_settings
    from preheat.history.db import session_scope, utcnow
    from preheat.schedules import beat, store
    from tests.conftest import SUPPORT_PROMPT, _point_app

    url = fake_vllm("--dev-mode", "--enable-prompt-tokens-details")
    extra = (
        f'\n[endpoints.vllm]\nbase_url = "{url}/v1"\nkind = "vllm"\nmodel = "fake-model"\ntemplates = ["support"]\n'
        "\n[endpoints.vllm.sleep]\nlevel = 2\n"
    )
    write_catalog(embedded_stack.catalog.parent, tiny_model, extra)
    cli = embedded_stack.cli
    assert cli("schedule", "add", "night", "--cron", "0 22 * * *", "--action", "sleep", "-e", "vllm").returncode == 0
    wake = ("schedule", "add", "morning", "--cron", "0 7 * * *", "--lead", "60", "--action", "wake", "-e", "vllm")
    assert cli(*wake).returncode == 0
    clash = cli("schedule", "add", "late", "--cron", "0 22 * * *", "-e", "vllm", "-t", "support")
    assert clash.returncode == 2 and "same minute as schedule 'night'" in clash.stderr
    day = (utcnow() + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    _point_app(app, celery_config(get_settings()))
    worker = processes.start_worker("io@day", embedded_stack.env, tmp_path / "logs", cwd=embedded_stack.home)
    try:
        with processes.running(worker):
            processes.wait_for_log(worker, "io@day ready.")

            def fire(at) -> dict:
                assert list(beat.fire_due(at, "beat-test", grace_s=300, lease_s=15).values()) == ["sent"]
                with session_scope() as session:
                    [slot] = store.recent_slots(session, limit=1)

                def final():
                    run = json.loads(cli("history", str(slot.run_id)[:8], "--json").stdout)
                    return run if run["status"] in ("succeeded", "degraded", "failed") else None

                return processes.poll(final, 60, what=f"the slot at {at}")

            night = fire(day + dt.timedelta(hours=22, seconds=5))
            assert [(job["template"], job["status"], job["sleep_level"]) for job in night["jobs"]] == [
                ("*", "asleep", 2)
            ]
            assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
            morning = fire(day + dt.timedelta(days=1, hours=6, minutes=59, seconds=5))
            rows = {job["template"]: job for job in morning["jobs"]}
            assert (rows["*"]["status"], rows["support"]["status"]) == ("awake", "warm")
    finally:
        _point_app(app, None)
    body = {
        "model": "fake-model",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": SUPPORT_PROMPT}, {"role": "user", "content": "Hi, my order?"}],
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
        usage = [json.loads(line[5:]) for line in reply.iter_lines() if line.startswith("data: {")][-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the peak's first request: its prefix cached


def test_an_endpoint_without_sleep_is_refused_by_name_and_nothing_is_recorded(embedded_stack, tiny_model):
    extra = '\n[endpoints.plain]\nbase_url = "http://127.0.0.1:9/v1"\nkind = "vllm"\ntemplates = ["support"]\n'
    write_catalog(embedded_stack.catalog.parent, tiny_model, extra)
    for args in (
        ("sleep", "-e", "plain"),
        ("schedule", "add", "n", "--cron", "0 1 * * *", "--action", "wake", "-e", "plain"),
    ):
        refused = embedded_stack.cli_here(*args)
        assert refused.returncode == 2 and "endpoint 'plain' declares no sleep" in refused.stderr, refused.stderr
        assert "add [endpoints.plain.sleep]" in refused.stderr  # the hint as written, not eaten as markup
    assert json.loads(embedded_stack.cli_here("history", "--json").stdout) == []
    assert json.loads(embedded_stack.cli_here("schedule", "list", "--json").stdout) == []
