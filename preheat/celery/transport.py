"""The embedded default's broker: kombu's filesystem transport, with messages that appear
whole.

Kombu's own `_put` creates the message file under its final name, then locks and writes it;
its `_get` moves the first matching file away and reads it, without taking the lock. A
reader that comes between the two reads an empty file, and the worker stops with
"Unrecoverable error: JSONDecodeError('Expecting value: line 1 column 1 (char 0)')" (seen
here under load; celery/kombu#1551). Here a message is written under a name readers skip
and renamed into place, which is atomic within a folder. Its wait for a message can be
cut short (`wake`), so work handed to the consumer thread, or a stop, waits for nothing.

`preheat.celery` points kombu's `filesystem` alias at this module, so `filesystem://` means
this transport in every preheat process.
"""

from __future__ import annotations

import os
import threading
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, _transport_cache, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        """Put `payload` onto `queue`: written under a hidden name, then renamed into place."""
        # The same name kombu gives it: readers take messages in name order.
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # Starts with '.': a reader matches on what follows the first '.', which here is the
        # whole name plus '.part', never "<queue>.msg".
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


# Celery's loop for this transport (synloop) runs the work handed to the consumer thread
# (call_soon: start consuming a warm model's queue) and checks whether to stop only between
# waits for a message, and each wait lasts up to 2 s: a warm model waited that long for its
# queue, and a SIGTERM for the worker to stop. `wake()` ends the wait at the next poll.
_WAKE = threading.Event()
# Once the worker is asked to stop, every wait ends at its next poll: the stop request may
# be noted by Celery just after a wait began (its signal is sent before its flag is set).
_STOPPING = threading.Event()


def wake() -> None:
    """End the consumer's current wait for a message now (work was handed to it)."""
    _WAKE.set()


def stop_waiting() -> None:
    """The worker is stopping: no wait for a message lasts beyond the next poll."""
    _STOPPING.set()


class Transport(filesystem.Transport):
    Channel = Channel

    def drain_events(self, connection, timeout=None):
        started, poll = monotonic(), self.polling_interval or 0.05
        while True:
            try:
                return super().drain_events(connection, timeout=poll)
            except TimeoutError:
                if _STOPPING.is_set():
                    raise
                if _WAKE.is_set():
                    _WAKE.clear()
                    raise
                if timeout is not None and monotonic() - started >= timeout:
                    raise


def install() -> None:
    """Make `filesystem://` this transport (before any connection resolves it)."""
    TRANSPORT_ALIASES["filesystem"] = f"{__name__}:Transport"
    _transport_cache.pop("filesystem", None)
