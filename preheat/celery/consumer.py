"""The worker's consumer: Celery's, with one reconnect bug worked around.

Celery 5.7 handles a lost broker connection by *collecting* the connection, which on
Redis detaches its transport from it (``transport.client = None``), and only then closing
it. With a task running at that moment (any pool but solo: the consumer's loop runs beside
the task), two things still go through that transport: the close, which restores the
task's unacknowledged message, and the task's own ack when it finishes. Both then fail
with AttributeError ('NoneType' object has no attribute 'hostname'), which Celery reports
as an unrecoverable error, and the worker exits (celery/celery#9250 is the same crash
on AMQP). The transport is re-attached to the connection it came from, so both reach the
broker again: a broker still away is then a connection error Celery handles, and one that
is back takes the ack.
"""

from __future__ import annotations

from celery.worker.consumer import Consumer


class PreheatConsumer(Consumer):
    def on_connection_error_after_connected(self, exc):
        if self.connection is not None:
            self.connection.collect = _collect_keeping_transport(self.connection)
        super().on_connection_error_after_connected(exc)


def _collect_keeping_transport(connection):
    collect = connection.collect

    def collect_and_reattach(*args, **kwargs):
        transport = connection._transport
        try:
            return collect(*args, **kwargs)
        finally:
            if transport is not None and transport.client is None:
                transport.client = connection  # its channels (an unacked restore, a late ack) still work

    return collect_and_reattach
