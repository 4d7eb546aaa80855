"""`preheat exporter`: the fleet's metrics (preheat/fleet.py) for Prometheus to scrape.

One per fleet, a process of its own: read-only (it takes no command), so it needs no auth,
like the workers' health servers. `/metrics` only; everything else is 404.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import typer

from preheat.cli.lazy import get_settings, load_catalog

log = logging.getLogger(__name__)


def exporter(
    host: str = typer.Option("0.0.0.0", "--host", help="Address to listen on."),
    port: int = typer.Option(9441, "--port", min=0, max=65535, help="Port to listen on (0: a free one)."),
) -> None:
    """Serve fleet metrics from history, the registry and the broker on /metrics: jobs by
    status and trigger, last verified warm per worker and template, schedules' next fire,
    lead and slots, workers live / ready / asleep, outbox backlogs, queue depths."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import CollectorRegistry, make_wsgi_app

    from preheat.celery.app import app
    from preheat.celery.queues import infer_queue, waiting_messages
    from preheat.core.errors import ConfigError
    from preheat.fleet.exporter import FleetCollector

    settings = get_settings()
    catalog = load_catalog(settings.catalog)
    connection = app.connection_for_read()

    def queue_depth(model: str) -> int:
        return waiting_messages(connection.default_channel, infer_queue(model))

    metrics = CollectorRegistry(auto_describe=False)
    collector = FleetCollector(catalog, settings, queue_depth=queue_depth)
    list(collector.collect())  # the first, whole count now: a database that cannot serve it stops the start
    metrics.register(collector)
    served = make_wsgi_app(metrics)

    def only_metrics(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only /metrics here\n"]
        return served(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log_message(self, fmt, *args) -> None:
            log.debug("exporter %s - " + fmt, self.address_string(), *args)

    try:
        server = make_server(host, port, only_metrics, handler_class=Quiet)
    except OSError as exc:
        raise ConfigError(
            f"the exporter cannot listen on {host}:{port} ({exc.strerror}); pick another --port"
        ) from None
    print(f"preheat exporter on http://{host}:{server.server_port}/metrics", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    server.shutdown()
    connection.release()
