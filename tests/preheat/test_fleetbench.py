"""`preheat bench first-request`, `fanout` and `beat` as a user runs them: real worker
processes, a table, a JSON file. Behaviour only: the figures are the benchmark's business."""

import json

import pytest

pytestmark = pytest.mark.slow


def test_first_request_compares_gated_and_ungated_fresh_workers(embedded_stack, tmp_path):
    out = tmp_path / "first.json"
    done = embedded_stack.cli(
        "bench", "first-request", "--rounds", "1", "--steady", "3", "--json", str(out), timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "gated (after warm)" in done.stdout and "ungated (from start)" in done.stdout
    report = json.loads(out.read_text())
    gated, ungated = report["rows"]
    assert (gated["gated"], ungated["gated"]) == (True, False)
    for row in (gated, ungated):
        assert row["first_ttft_ms"] > 0 and row["steady_ttft_ms"] > 0 and row["rounds"] == 1
    # Gated, the first request starts from the pre-filled prefix; ungated, the worker had to
    # load the model and pre-fill during that request, which the worker's TTFT includes.
    assert gated["first_cached_tokens"] > 0
    assert ungated["first_ttft_ms"] > gated["first_ttft_ms"]
    assert set(report["target"]) == {"first_over_steady", "met"}


def test_fanout_warms_fresh_fleets_and_reports_total_against_the_slowest(embedded_stack, tmp_path):
    out = tmp_path / "fanout.json"
    done = embedded_stack.cli("bench", "fanout", "--workers", "1,2", "--rounds", "1", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [row["workers"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert sum(row["statuses"].values()) == row["workers"]  # one template in the test catalog
        assert "failed" not in row["statuses"] and "lost" not in row["statuses"]
        assert 0 < row["slowest_worker_s"] <= row["total_s"]
    listed = embedded_stack.cli("workers", "--json")
    assert json.loads(listed.stdout) == []  # every worker it started is stopped


def test_benchmarks_refuse_when_other_workers_would_take_part(embedded_stack):
    from preheat.fleet import registry
    from preheat.history.db import session_scope, utcnow

    with session_scope() as session:
        registry.beat(session, "someone@else", started_at=utcnow(), ready=True, state={})
    done = embedded_stack.cli("bench", "fanout", "--workers", "1")
    assert done.returncode == 2 and "live worker(s) would take part: someone@else" in done.stderr
    bad = embedded_stack.cli("bench", "fanout", "--workers", "0")
    assert bad.returncode == 2 and "between 1 and 16" in bad.stderr


def test_connect_measures_fresh_preopened_and_steady_against_preheat_serve_over_tls(embedded_stack, tmp_path):
    out = tmp_path / "connect.json"
    done = embedded_stack.cli("bench", "connect", "--rounds", "3", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "fresh client (TCP + TLS on the request)" in done.stdout and "pre-opened pool" in done.stdout
    report = json.loads(out.read_text())
    assert report["rounds"] == 3 and report["measured_against"] == "preheat serve over TLS on loopback"
    assert report["target"] == {"preopened_over_steady": "<= 1.2", "met": report["preopened_over_steady"] <= 1.2}
    for way in ("fresh_ms", "preopened_ms", "steady_ms", "establish_ms"):
        assert report[way] > 0
    assert (embedded_stack.home / "bench" / "tls" / "ca.pem").exists()  # its own CA, made for the run
    unknown = embedded_stack.cli("bench", "connect", "--endpoint", "nope")
    assert unknown.returncode == 2 and "unknown endpoint 'nope'" in unknown.stderr


def test_beat_bench_fires_every_slot_once_through_a_killed_leader(embedded_stack, tmp_path):
    stack = embedded_stack
    stack.env.update(PREHEAT_BEAT_LEASE_S="3", PREHEAT_BEAT_TICK_S="0.5")
    out = tmp_path / "beat.json"
    done = stack.cli(
        "bench", "beat", "--slots", "4", "--spacing", "2", "--kill-after", "1", "--json", str(out), timeout=300
    )
    assert done.returncode == 0, done.stderr + done.stdout
    assert "leader (before the kill)" in done.stdout and "4 of 4 slots sent, 4 run(s) recorded" in done.stdout
    report = json.loads(out.read_text())
    assert report["lease_s"] == 3 and report["runs"] == 4 and 0 < report["takeover_s"] < 3 + 0.5 + 2
    assert sum(phase["sent"] for phase in report["phases"]) == 4
    assert {slot["status"] for slot in report["slots_detail"]} == {"sent"}
    bad = stack.cli_here("bench", "beat", "--slots", "10", "--spacing", "6")
    assert bad.returncode == 2 and "under 55 s" in bad.stderr


def test_route_compares_routed_with_the_shared_queue_on_one_fleet(embedded_stack, tmp_path):
    out = tmp_path / "route.json"
    # 2 workers pinning 2 each, 4 templates: each template one holder.
    args = ["--workers", "2", "--factor", "2", "--users", "2", "--turns", "3", "--requests", "8", "--words", "40"]
    done = embedded_stack.cli("bench", "route", "--shape", "tiny", *args, "--json", str(out), timeout=420)
    assert done.returncode == 0, done.stderr + done.stdout[-3000:]
    assert "routed vs the shared queue: 2 workers, 4 templates (2 pinnable per worker)" in done.stdout
    report = json.loads(out.read_text())
    assert [row["mode"] for row in report["rows"]] == ["routed", "shared"]
    routed, shared = report["requests"]["routed"], report["requests"]["shared"]
    for asked in (routed, shared):
        assert len([a for a in asked if a["phase"] == "conversation"]) == 2 * 3
        assert len([a for a in asked if a["phase"] == "template"]) == 8
    # Routed: a conversation's later turns stay on the worker that answered its first, from
    # its remembered turns; a template request goes to a holder (or says why not).
    for later in (a for a in routed if a["phase"] == "conversation" and a["turn"] > 1):
        assert later["route"] == "holds the conversation"
        assert later["cached_tokens"] > 0
    for asked in (a for a in routed if a["phase"] == "template"):
        assert asked["from_pinned"] == asked["route"].startswith("holds template")
    assert all(a["route"] == "routing off (PREHEAT_ROUTING)" for a in shared)
    assert set(report["targets"]["met"]) == {
        "cached_share",
        "ttft_p50_ratio",
        "from_pinned",
        "no_queue_over_bound_while_idle",
    }
    assert json.loads(embedded_stack.cli("workers", "--json").stdout) == []  # its workers are stopped
