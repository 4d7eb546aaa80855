"""Beat fires the catalog's schedules as fleet warmups, through the real broker."""

import base64
import json

import pytest
from celery.schedules import crontab

from preheat import procs
from preheat.celery import create_app
from preheat.settings import get_settings
from schedules.beat import CatalogScheduler
from tests.conftest import write_catalog

MORNING = '\n[schedules.morning]\ncron = "50 8 * * 1-5"\ntemplates = ["support"]\n'


@pytest.fixture
def services(services_stack, tmp_path, tiny_model, apply_env):
    stack = services_stack
    catalog = write_catalog(tmp_path, tiny_model, MORNING)
    apply_env({**stack.env, "PREHEAT_CATALOG": str(catalog)})
    stack.env["PREHEAT_CATALOG"] = str(catalog)
    return stack


def test_the_scheduler_sends_warm_fleet_with_the_schedule_as_trigger(services, redis_client):
    app = create_app(get_settings())
    scheduler = CatalogScheduler(app=app, schedule_filename=app.conf.beat_schedule_filename)
    try:
        entry = scheduler.schedule["schedule:morning"]
        assert entry.schedule == crontab("50", "8", "1-5", "*", "*")
        with app.producer_or_acquire() as producer:
            scheduler.apply_entry(entry, producer=producer)
    finally:
        scheduler.close()
    [raw] = redis_client.lrange("preheat", 0, -1)
    message = json.loads(raw)
    assert message["headers"]["task"] == "preheat.warm_fleet"
    assert message["content-type"] == "application/json"
    body = json.loads(base64.b64decode(message["body"]))
    assert body[1] == {"templates": ["support"], "trigger": "schedule", "detail": {"schedule": "morning"},
                       "requested_by": "beat"}


@pytest.mark.slow
def test_celery_beat_starts_with_the_catalog_schedules(services, tmp_path):
    beat = procs.start("beat", procs.celery_command("beat", "--loglevel=DEBUG"), services.env, tmp_path / "logs")
    with procs.running(beat):
        procs.wait_for_log(beat, "beat: 1 catalog schedule(s): schedule:morning")
        # Logged once the schedule is set up and the loop runs: stopping earlier races the shelve.
        procs.wait_for_log(beat, "beat: Ticking with max interval")
    assert "Traceback" not in beat.log(), beat.log()


def test_each_endpoint_gets_a_keep_alive_entry_below_its_prompt_cache_ttl(tmp_path, tiny_model):
    import datetime as dt

    from preheat.catalog import load_catalog
    from schedules.beat import catalog_entries

    catalog = load_catalog(write_catalog(tmp_path, tiny_model, MORNING + (
        '\n[endpoints.hosted]\nbase_url = "https://api.example/v1"\ntemplates = ["support"]\n'
        '\n[endpoints.quiet]\nbase_url = "https://api.example/v1"\ntemplates = ["support"]\nkeepalive_interval_s = 0.5\n'
        'prompt_cache_ttl_s = 1\n'
        '\n[endpoints.no-templates]\nbase_url = "https://api.example/v1"\n')))
    entries = catalog_entries(catalog)
    assert sorted(entries) == ["keepalive:hosted", "keepalive:quiet", "schedule:morning"]
    hosted = entries["keepalive:hosted"]
    assert hosted["task"] == "preheat.keep_alive_endpoint" and hosted["kwargs"] == {"endpoint": "hosted"}
    assert hosted["schedule"] == dt.timedelta(seconds=270) and hosted["options"] == {"expires": 270}
