"""`preheat serve`: the OpenAI-compatible model server (workers/serve.py) as a process."""

from __future__ import annotations

import logging
import signal
import ssl
import threading

import typer

from preheat.core.errors import ConfigError

log = logging.getLogger("preheat.serve")


def _tls_context(cert, key) -> ssl.SSLContext | None:
    if cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {cert} / key {key}: {exc}") from None
    context.set_alpn_protocols(["http/1.1"])
    return context


def serve(
    host: str = typer.Option(None, help="Address to listen on (default PREHEAT_SERVE_HOST, 0.0.0.0)."),
    port: int = typer.Option(None, min=0, max=65535, help="Port (default PREHEAT_SERVE_PORT, 8000; 0 = free)."),
) -> None:
    """Serve the catalog's models over HTTP, OpenAI-compatible, from the cached prefixes:
    every model loaded and every template pre-filled at start; /health/ready says when."""
    from preheat.core import startheap

    startheap.hold_collector()  # until the models are resident (preheat.core.startheap)
    import tornado.ioloop

    from preheat.core.settings import get_settings
    from preheat.workers.runtime import WorkerRuntime
    from preheat.workers.serve import ServeConfig, Server, listen

    logging.basicConfig(level=get_settings().log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    context = _tls_context(settings.serve_tls_cert, settings.serve_tls_key)
    runtime = WorkerRuntime.from_settings(settings)
    config = ServeConfig(
        token=settings.serve_token.get_secret_value() if settings.serve_token else None,
        api_key=settings.serve_api_key.get_secret_value() if settings.serve_api_key else None,
        max_body_bytes=int(settings.serve_max_body_bytes),
    )
    server = Server(runtime, config)
    host, port = settings.serve_host if host is None else host, settings.serve_port if port is None else port
    if not host.strip():
        raise ConfigError("--host must not be empty (0.0.0.0 listens on every interface)")
    try:
        http, bound = listen(server, host, port, context)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); set PREHEAT_SERVE_PORT") from None
    scheme = "https" if context else "http"
    log.info(
        "preheat serve on %s://%s:%d (internal endpoints %s)",
        scheme,
        host,
        bound,
        "on" if config.token else "off: no PREHEAT_SERVE_TOKEN",
    )
    threading.Thread(target=runtime.preload, name="preheat-preload", daemon=True).start()
    loop = tornado.ioloop.IOLoop.current()

    def shutdown() -> None:
        log.info("preheat serve stopping")
        loop.stop()

    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        loop.asyncio_loop.add_signal_handler(stop_signal, shutdown)
    loop.start()
    http.stop()
    server.executor.shutdown(wait=False, cancel_futures=True)
    runtime.close()
