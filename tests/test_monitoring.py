"""Monitoring as shipped in deploy/: the alert rules pass `promtool check rules` and their unit
tests (`promtool test rules`), and every metric the Grafana dashboard and the rules query is
one preheat exports, read from a real worker's /metrics and a real `preheat exporter`'s."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from preheat.core import processes
from tests.conftest import PREHEAT_CLI, write_catalog

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "preheat-alerts.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "preheat-alerts.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "preheat-fleet.json"
METRIC = re.compile(r"\b(preheat_[a-z_]+)\b")
# Names PromQL derives from a histogram's base name.
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed: it comes with Debian's prometheus package (`make test` installs it)")
    return found


def test_the_alert_rules_are_valid_and_their_unit_tests_pass():
    checked = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0 and "SUCCESS: 8 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name], capture_output=True, text=True, cwd=RULE_TESTS.parent
    )
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_alert_has_a_test_that_fires_it_and_one_that_does_not():
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    fired, quiet = set(), set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == alerts and quiet == alerts


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    titles = [panel["title"] for panel in panels]
    assert len(titles) == len(set(titles)) and all(panel["targets"] for panel in panels)
    assert all(panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for panel in panels)
    return [target["expr"] for panel in panels for target in panel["targets"]]


def rule_queries() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def exported_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            names.add(name)
            names.update(name.removesuffix(suffix) for suffix in HISTOGRAM_SUFFIXES if name.endswith(suffix))
    return names


@pytest.mark.slow
def test_every_metric_the_dashboard_and_the_rules_query_is_exported(embedded_stack, embedded_app, tmp_path, tiny_model):
    from preheat.fleet.routing import send_infer as routed_infer
    from preheat.history.db import session_scope, utcnow
    from preheat.history.models import Schedule, ScheduleSlot, SlotStatus
    from tests.tasks.test_worker import send_infer

    with session_scope() as session:  # a schedule with a sent slot: its series exist
        schedule = Schedule(name="morning", cron="0 9 * * *", targets={"templates": ["support"]}, lead_time_s=60)
        session.add(schedule)
        session.flush()
        now = utcnow()
        session.add(
            ScheduleSlot(
                schedule_id=schedule.id,
                schedule_name="morning",
                slot_at=now,
                fire_at=now - dt.timedelta(minutes=1),
                status=SlotStatus.sent,
                claimed_at=now,
            )
        )
    # A LoRA adapter of the model, so the adapter series exist too.
    write_catalog(tmp_path, tiny_model, f'\n[models.tiny.adapters]\nacme = "{_adapter(tiny_model, tmp_path)}"\n')
    worker = processes.start_worker("w1@monitoring", embedded_stack.env, tmp_path / "logs", cwd=embedded_stack.home)
    exporter = None
    with processes.running(worker):
        send_infer().get(timeout=120)  # a request served: its histogram has samples
        routed_infer(embedded_app, {"model": "acme", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        done = embedded_stack.cli("warm", "--wait", "--json")
        assert done.returncode == 0, done.stderr
        worker_metrics = httpx.get(f"{processes.health_url(worker)}/metrics").text
        exporter = subprocess.Popen(
            [PREHEAT_CLI, "exporter", "--port", "0"], env=embedded_stack.env, stdout=subprocess.PIPE, text=True
        )
        try:
            url = re.search(r"http://\S+/metrics", exporter.stdout.readline()).group(0)
            fleet_metrics = httpx.get(url.replace("0.0.0.0", "127.0.0.1")).text
        finally:
            exporter.terminate()
            exporter.wait(10)
    exported = exported_names(worker_metrics) | exported_names(fleet_metrics)
    for source, queries in (("dashboard", dashboard_queries()), ("alert rules", rule_queries())):
        named = {name for query in queries for name in METRIC.findall(query)}
        assert named and named <= exported, f"{source} queries what preheat does not export: {named - exported}"


NAME = re.compile(r"^preheat_[a-z][a-z0-9_]*$")
# Labels of bounded cardinality: a fleet's workers, models, templates, schedules, and enums.
LABELS = {"model", "cache", "template", "worker", "schedule", "status", "trigger", "action", "state", "sleep_state"}
LABELS |= {"le", "path", "code", "queue"}  # queue: own | shared (preheat_requests_taken_total)
LABELS |= {"adapter"}  # a catalog's LoRA adapters (preheat_adapter_requests_total)


def _adapter(model_dir, tmp_path):
    from preheat.cli.devadapter import make_adapter

    folder = tmp_path / "adapters" / "acme"
    return folder if folder.is_dir() else make_adapter(model_dir, folder, rank=4)


def test_worker_and_fleet_metric_names_follow_the_conventions(embedded_stack, tmp_path, tiny_model):
    """Counters end in _total, times and sizes are in base units (_seconds, _bytes), and every
    label is of bounded cardinality. Read from what a runtime and the fleet collector render."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from preheat.api.sampling import SamplingParams
    from preheat.core.catalog import load_catalog
    from preheat.core.settings import get_settings
    from preheat.fleet.exporter import FleetCollector
    from tests.workers.test_runtime import make_runtime

    runtime = make_runtime(
        tmp_path, tiny_model, f'\n[models.tiny.adapters]\nacme = "{_adapter(tiny_model, tmp_path)}"\n'
    )
    runtime.preload()
    runtime.infer("support", "Where is my parcel?", SamplingParams(max_tokens=2))
    runtime.generate_chat("acme", [{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2)).collect()
    fleet = CollectorRegistry(auto_describe=False)
    fleet.register(FleetCollector(load_catalog(get_settings().catalog), get_settings(), queue_depth=lambda m: 0))
    for text in (runtime.render_metrics().decode(), generate_latest(fleet).decode()):
        for family in text_string_to_metric_families(text):
            assert NAME.match(family.name), family.name
            assert not re.search(r"_(ms|milliseconds|kb|kib|mb|mib|minutes|hours)(_|$)", family.name), family.name
            for sample in family.samples:
                if family.type == "counter":
                    assert sample.name.endswith(("_total", "_created")), sample.name
                assert set(sample.labels) <= LABELS, (sample.name, sample.labels)
    runtime.close()


@pytest.mark.slow
def test_a_real_prometheus_accepts_every_dashboard_query_and_the_snapshot_draws_them(embedded_stack, tmp_path):
    """Debian's Prometheus (the package promtool comes in) scrapes a real exporter; every
    panel's query runs through its query_range API without an error, and the snapshot is
    one offline page."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.fail(
            "prometheus is not installed: Debian's prometheus package (`make test` installs it: .ci/install-test-tools)"
        )
    exporter = subprocess.Popen(
        [PREHEAT_CLI, "exporter", "--port", "0"], env=embedded_stack.env, stdout=subprocess.PIPE, text=True
    )
    server = None
    try:
        target = re.search(r"http://0.0.0.0:(\d+)/metrics", exporter.stdout.readline()).group(1)
        config = tmp_path / "prometheus.yml"
        scrape = {"job_name": "preheat-exporter", "static_configs": [{"targets": [f"127.0.0.1:{target}"]}]}
        config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [scrape]}))
        port = processes.free_port()
        server = subprocess.Popen(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"

        def scraped():
            try:
                response = httpx.get(f"{url}/api/v1/query", params={"query": "preheat_fleet_workers"})
            except httpx.HTTPError:
                return False
            if response.status_code == 503:  # "Service Unavailable" in plain text while it starts
                return False
            answer = response.json()
            return answer["status"] == "success" and answer["data"]["result"]

        processes.poll(scraped, 60, 0.5, "the exporter scraped")
        out = tmp_path / "dashboard.html"
        done = embedded_stack.cli(
            "dev", "dashboard-snapshot", "--prometheus", url, "--dashboard", str(DASHBOARD), "--out", str(out)
        )
        assert done.returncode == 0, done.stderr
        page = out.read_text()
        panels = [panel for panel in json.loads(DASHBOARD.read_text())["panels"] if panel["type"] != "row"]
        assert page.count("<figure") == len(panels)
        assert 'http-equiv="Content-Security-Policy"' in page and "<script" not in page
        broken = tmp_path / "broken.json"
        broken.write_text(
            json.dumps({"panels": [{"type": "timeseries", "title": "bad", "targets": [{"expr": "rate(x["}]}]})
        )
        refused = embedded_stack.cli(
            "dev", "dashboard-snapshot", "--prometheus", url, "--dashboard", str(broken), "--out", str(out)
        )
        assert refused.returncode == 2 and "Prometheus refused a query of the dashboard: panel 'bad'" in refused.stderr
    finally:
        exporter.terminate()
        exporter.wait(10)
        if server is not None:
            server.terminate()
            server.wait(10)
