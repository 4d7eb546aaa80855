"""The embedded broker under a real race: another process publishes while this one consumes.
Kombu's own filesystem transport hands the consumer empty files here (JSONDecodeError within
the first few dozen messages, celery/kombu#1551); preheat's writes each message whole."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kombu import Connection
from kombu.transport import resolve_transport

from preheat.celery import transport

MESSAGES = 1000

PRODUCER = """
import sys
from kombu import Connection
from preheat.celery import transport
transport.install()
folder = sys.argv[1]
options = {"data_folder_in": folder, "data_folder_out": folder, "control_folder": folder}
with Connection("filesystem://", transport_options=options) as connection:
    queue = connection.SimpleQueue("race")
    for n in range(int(sys.argv[2])):
        queue.put({"n": n, "pad": "x" * 20000})
"""


def test_the_app_uses_preheats_filesystem_transport():
    import preheat.celery.app  # noqa: F401 - the app installs it

    assert resolve_transport("filesystem") is transport.Transport


def test_a_consumer_racing_a_producer_in_another_process_gets_every_message_whole(tmp_path):
    transport.install()
    options = {
        "data_folder_in": str(tmp_path),
        "data_folder_out": str(tmp_path),
        "control_folder": str(tmp_path),
        "store_processed": False,
        "polling_interval": 0.0,
    }
    with Connection("filesystem://", transport_options=options) as connection:
        queue = connection.SimpleQueue("race")  # declared before the producer starts
        producer = subprocess.Popen([sys.executable, "-c", PRODUCER, str(tmp_path), str(MESSAGES)])
        received = []
        try:
            while len(received) < MESSAGES:
                message = queue.get(timeout=60)
                received.append(message.payload["n"])
                message.ack()
        finally:
            assert producer.wait(60) == 0
    assert sorted(received) == list(range(MESSAGES))
    assert not [name for name in tmp_path.iterdir() if name.name.endswith(".part")]


def test_a_wait_for_a_message_holds_its_timeout_and_ends_when_woken(tmp_path):
    """Celery's loop waits for a message before it runs work handed to the consumer or looks
    whether to stop: a wake-up ends the wait. A caller's own timeout still holds in full."""
    import threading

    transport.install()
    options = {
        "data_folder_in": str(tmp_path),
        "data_folder_out": str(tmp_path),
        # kombu's default is "control" under the working directory: the checkout, once.
        "control_folder": str(tmp_path),
        "polling_interval": 0.01,
    }
    with Connection("filesystem://", transport_options=options) as connection:
        queue = connection.SimpleQueue("idle")
        queue.put({"n": 1})
        assert queue.get(timeout=5).payload == {"n": 1}  # a message arrives through the slices
        outcome = []

        def wait() -> None:
            try:
                connection.drain_events()  # no timeout: until a message, or the worker stops
            except TimeoutError:
                outcome.append("woken")

        waiting = threading.Thread(target=wait, daemon=True)
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive()  # no message: still waiting, past many slices
        transport.wake()
        waiting.join(30)
        assert outcome == ["woken"]
        queue.put({"n": 2})  # a wake-up ends one wait: the next gets its message as usual
        assert queue.get(timeout=5).payload == {"n": 2}
        transport.stop_waiting()  # a stopping worker: no wait outlasts a poll, however long asked
        try:
            with pytest.raises(TimeoutError):
                connection.drain_events(timeout=3600)
        finally:
            transport._STOPPING.clear()
