"""Endpoints against a real `preheat serve` over TLS (a CA made here): pools opened ahead of
time, warmups recorded in history through a real worker, keep-alive counted."""

from __future__ import annotations

import datetime as dt
import json
import ssl

import httpx
import pytest

from preheat.cli.bench.connect import make_tls
from preheat.core import processes
from preheat.core.catalog import EndpointSpec, load_catalog
from preheat.core.errors import ConfigError
from preheat.endpoints.pools import POOLS, EndpointPools
from preheat.history import service
from preheat.history.db import session_scope
from preheat.tasks.arguments import KeepAliveArguments
from tests.conftest import write_catalog
from tests.workers.test_serve import TOKEN

pytestmark = pytest.mark.slow


def trusting(ca_path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca_path))


@pytest.fixture
def tls(tmp_path):
    return make_tls(tmp_path / "tls")


@pytest.fixture
def tls_server(embedded_stack, tmp_path, tls):
    env = {
        **embedded_stack.env,
        "PREHEAT_SERVE_TOKEN": TOKEN,
        "PREHEAT_SERVE_TLS_CERT": str(tls["cert"]),
        "PREHEAT_SERVE_TLS_KEY": str(tls["key"]),
    }
    proc = processes.start_serve(env, tmp_path / "logs")
    with processes.running(proc):
        url = processes.serve_url(proc)
        assert url.startswith("https://")
        processes.poll(
            lambda: httpx.get(f"{url}/health/ready", verify=trusting(tls["ca"]), timeout=5).status_code == 200,
            60,
            what="ready",
        )
        yield url, proc


def _connections_opened(url: str, ca) -> float:
    # Read with a client of its own, which opens (and counts) one more connection.
    text = httpx.get(f"{url}/metrics", verify=trusting(ca), timeout=5).text
    return float(
        next(line.split()[1] for line in text.splitlines() if line.startswith("preheat_http_connections_opened_total"))
    )


@pytest.mark.parametrize("http2", [False, True])
def test_min_connections_are_established_before_any_request_and_closed_on_shutdown(tls_server, tls, http2):
    url, _ = tls_server
    spec = EndpointSpec(
        base_url=f"{url}/v1",
        kind="preheat",
        min_connections=3,
        max_connections=5,
        ca_bundle=str(tls["ca"]),
        http2=http2,
        templates=["support"],
    )
    pools = EndpointPools()
    before = _connections_opened(url, tls["ca"])
    with pools.lease("local", spec) as (pool, opened):
        pass
    assert opened and pool.opened_ms > 0
    assert pool.open_connections() == 3 and all(c.is_idle() for c in pool.connections())
    assert _connections_opened(url, tls["ca"]) == before + 1 + 3  # the pool's three, and this read's own

    # Requests go through those connections: none opens another.
    with pools.lease("local", spec) as (again, opened_again):
        assert again is pool and not opened_again
    for _ in range(5):
        assert pool.client.get(f"{url}/health/live").status_code == 200
    assert pool.open_connections() == 3
    assert _connections_opened(url, tls["ca"]) == before + 2 + 3

    pools.close_all()
    assert pool.open_connections() == 0 and pool.client.is_closed


def test_a_pool_discarded_while_leased_closes_when_its_last_lease_ends(tls_server, tls):
    """Warmups and keep-alives run on several pool threads: one warmup's discard (or a changed
    catalog entry) must not close connections another is reading from."""
    url, _ = tls_server
    spec = EndpointSpec(base_url=f"{url}/v1", kind="preheat", min_connections=1, ca_bundle=str(tls["ca"]))
    pools = EndpointPools()
    with pools.lease("pod", spec) as (first, _), pools.lease("pod", spec) as (second, _):
        assert first is second and first.leases == 2
        pools.discard("pod")
        assert not first.client.is_closed
        assert first.client.get(f"{url}/health/live").status_code == 200
        with pools.lease("pod", spec.model_copy(update={"min_connections": 2})) as (fresh, opened):
            assert opened and fresh is not first  # a new pool for later callers
    assert first.client.is_closed and first.leases == 0
    assert fresh.client.is_closed is False and fresh.leases == 0
    pools.close_all()


def test_a_server_whose_certificate_is_not_trusted_is_a_clear_failure(embedded_stack, tls_server):
    url, _ = tls_server
    from preheat.endpoints.warmup import warm_endpoint

    catalog = load_catalog(embedded_stack.catalog)
    [result] = warm_endpoint(
        "untrusted", EndpointSpec(base_url=f"{url}/v1", kind="openai", templates=["support"]), catalog, ["support"]
    )
    assert result.status == "failed" and "cannot open connections" in result.error
    assert "CERTIFICATE_VERIFY_FAILED" in result.error


@pytest.fixture
def endpoints_catalog(embedded_stack, tls_server, tls, tiny_model, tmp_path):
    """The stack's catalog with two endpoints on the TLS server: one primed through its
    completions route (as vLLM is), one through preheat's own /internal/warmup."""
    url, _ = tls_server
    extra = (
        f'\n[endpoints.as-vllm]\nbase_url = "{url}/v1"\nkind = "openai"\nmodel = "tiny"\nmin_connections = 2\n'
        f'ca_bundle = "{tls["ca"]}"\ntemplates = ["support"]\n'
        f'\n[endpoints.as-preheat]\nbase_url = "{url}/v1"\nkind = "preheat"\ntoken_env = "TEST_SERVE_TOKEN"\n'
        f'ca_bundle = "{tls["ca"]}"\ntemplates = ["support"]\n'
    )
    return write_catalog(tmp_path, tiny_model, extra)


def test_a_warmup_of_two_endpoints_is_recorded_with_connect_time_and_ttft(embedded_stack, endpoints_catalog, tmp_path):
    env = {**embedded_stack.env, "TEST_SERVE_TOKEN": TOKEN}
    worker = processes.start_worker("io@endpoint-test", env, tmp_path / "logs", cwd=embedded_stack.home)
    with processes.running(worker):
        processes.wait_for_log(worker, "io@endpoint-test ready.")
        # Once its own model is loaded: the server's probe, timed against its steady state,
        # must not share the two cores with a model load (seen: degraded on a fresh clone).
        processes.wait_for_log(worker, "preload done")
        done = embedded_stack.cli(
            "warm", "--endpoint", "as-vllm", "--endpoint", "as-preheat", "--wait", "--json", "--timeout", "120"
        )
        assert done.returncode == 0, done.stderr + worker.log()[-3000:]
    printed = json.loads(done.stdout)
    with session_scope() as session:
        run = service.find_run(session, printed["id"])
        jobs = {job.target: job for job in run.jobs}
    assert sorted(jobs) == ["as-preheat", "as-vllm"]
    for job in jobs.values():
        assert job.status.value == "warm" and str(job.target_kind) == "endpoint"
        assert job.connect_ms > 0 and job.ttft_cold_ms > 0 and job.ttft_warm_ms > 0
        assert job.cached_tokens > 20  # the server's usage says the prefix came from its cache
    assert jobs["as-preheat"].prefill_ms is not None  # preheat's own warmup measures its prefill
    assert "preheat.warm_endpoint[" in worker.log() and TOKEN not in worker.log()


def test_keep_alive_pings_within_active_hours_and_counts_what_it_skips(
    embedded_stack, endpoints_catalog, tls, monkeypatch
):
    from preheat.endpoints import keepalive
    from preheat.tasks.endpoints import keep_alive_endpoint

    monkeypatch.setenv("PREHEAT_CATALOG", str(endpoints_catalog))
    from preheat.core.settings import get_settings

    get_settings.cache_clear()
    now = dt.datetime.now(dt.UTC)
    inside = f"{now - dt.timedelta(hours=1):%H}:00-{now + dt.timedelta(hours=1):%H}:59"
    try:
        assert keep_alive_endpoint.run(KeepAliveArguments(endpoint="as-vllm")) == {
            "sent": 1,
            "failed": 0,
            "skipped": False,
        }
        assert keep_alive_endpoint.run(KeepAliveArguments(endpoint="as-vllm")) == {
            "sent": 1,
            "failed": 0,
            "skipped": False,
        }
        catalog = load_catalog(endpoints_catalog)
        outside = f"{now + dt.timedelta(hours=2):%H}:00-{now + dt.timedelta(hours=3):%H}:00"
        for hours, expected in ((outside, True), (inside, False)):
            spec = catalog.endpoint("as-vllm").model_copy(update={"active_hours": hours})
            assert keepalive.keep_alive("as-vllm", spec, catalog, now).skipped is expected
        with session_scope() as session:
            [row] = service.keepalives(session)
        assert (row.endpoint, row.pings_sent, row.pings_failed) == ("as-vllm", 2, 0)
        assert row.last_ttft_ms > 0 and row.last_error is None
        listed = embedded_stack.cli("endpoints", "--json")
        assert [(e["endpoint"], e["pings_sent"]) for e in json.loads(listed.stdout)] == [
            ("as-vllm", 2),
            ("as-preheat", 0),
        ]
    finally:
        POOLS.close_all()


def test_keep_alive_runs_below_the_prompt_cache_ttl():
    with pytest.raises(ValueError, match="must be below prompt_cache_ttl_s"):
        EndpointSpec(base_url="http://x/v1", keepalive_interval_s=300, prompt_cache_ttl_s=300)


def test_an_api_key_variable_that_is_not_set_is_a_clear_error(monkeypatch):
    from preheat.endpoints.pools import build_client

    monkeypatch.delenv("NOT_SET_KEY", raising=False)
    with pytest.raises(ConfigError, match="api_key_env variable NOT_SET_KEY is not set"):
        build_client("hosted", EndpointSpec(base_url="https://api.example/v1", api_key_env="NOT_SET_KEY"))
