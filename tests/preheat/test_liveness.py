"""Pulses through the broker, on both kinds: a Redis key with a time to live, and a file
beside the embedded broker's folders; both read back what was written, and an absent or
unreachable broker is no evidence either way."""

from __future__ import annotations

import datetime as dt

from preheat.core.settings import load_settings
from preheat.fleet.liveness import FilePulses, Pulse, RedisPulses, pulses_for, read_quietly
from tests.conftest import REDIS_URL

AT = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.UTC)


def test_a_redis_pulse_is_read_back_and_expires(redis_client):
    pulses = RedisPulses(REDIS_URL, ttl_s=30)
    pulses.write("gpu0@node-1", Pulse(AT, AT - dt.timedelta(seconds=7), pending=3))
    pulses.write("gpu1@node-1", Pulse(AT, None))
    assert pulses.read("gpu0@node-1") == Pulse(AT, AT - dt.timedelta(seconds=7), pending=3)
    assert pulses.read("gpu1@node-1") == Pulse(AT, None)
    assert pulses.read("never@node-1") is None
    assert 0 < redis_client.ttl("preheat:pulse:gpu0@node-1") <= 30  # a dead worker's pulse goes away


def test_a_file_pulse_is_read_back_whole(tmp_path):
    pulses = FilePulses(tmp_path / "pulse")
    pulses.write("gpu0@node/1", Pulse(AT, None))
    assert pulses.read("gpu0@node/1") == Pulse(AT, None)
    assert [p.name for p in (tmp_path / "pulse").iterdir()] == ["gpu0_node_1.json"]  # no temporary left
    (tmp_path / "pulse" / "gpu0_node_1.json").write_text("{half a")
    assert pulses.read("gpu0@node/1") is None


def test_where_pulses_live_follows_the_broker(tmp_path):
    assert isinstance(pulses_for(load_settings(home=tmp_path)), FilePulses)
    assert isinstance(pulses_for(load_settings(broker_url="redis://127.0.0.1:6379/11")), RedisPulses)
    assert pulses_for(load_settings(broker_url="amqp://guest:guest@127.0.0.1:5672//")) is None


def test_an_unreachable_broker_is_no_evidence():
    from preheat.core import processes

    pulses = RedisPulses(f"redis://127.0.0.1:{processes.free_port()}/0", ttl_s=30)
    assert read_quietly(pulses, "gpu0@node-1") is None
    assert read_quietly(None, "gpu0@node-1") is None
