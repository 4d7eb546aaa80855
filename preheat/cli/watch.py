"""`preheat watch-pods` and `preheat watch-workers`: the watchers that warm what comes up.

Both run until SIGTERM or Ctrl-C, log each warmup they send, and reconnect on their own.
"""

from __future__ import annotations

import logging
import signal

import typer

from preheat.cli.lazy import get_settings
from preheat.core.errors import ConfigError


def _run_until_signalled(watcher) -> None:
    logging.basicConfig(level=get_settings().log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: watcher.stop())
    watcher.run()


def watch_pods(
    namespace: list[str] = typer.Option(None, "--namespace", "-n", help="Namespace of the pods (repeatable)."),
    all_namespaces: bool = typer.Option(False, "--all-namespaces", "-A", help="Watch pods in every namespace."),
    selector: str = typer.Option(None, "--selector", "-l", help="Label selector, e.g. app=vllm."),
    endpoint: str = typer.Option(
        None, "--endpoint", "-e", help="Pods are replicas of this catalog endpoint: warm each at its IP and port."
    ),
    worker_name: str = typer.Option(
        None, "--worker-name", help='Pods are preheat workers named like this, e.g. "gpu0@{pod}".'
    ),
    port: int = typer.Option(None, "--port", min=1, max=65535, help="The server's port (default: --port-name's)."),
    port_name: str = typer.Option("http", "--port-name", help="Container port to use when --port is not given."),
    template: list[str] = typer.Option(None, "--template", "-t", help="Templates to prime (default: the target's)."),
    settle_s: float = typer.Option(5.0, "--settle-s", min=0.0, help="Wait after Ready before warming."),
    kubeconfig: str = typer.Option(None, "--kubeconfig", help="Default: in-cluster, else ~/.kube/config."),
    context: str = typer.Option(None, "--context", help="kubeconfig context."),
) -> None:
    """Warm each pod once when it becomes Ready (or is first seen Ready)."""
    from preheat.core.catalog import load_catalog
    from preheat.fleet.dispatch import prime_dispatch
    from preheat.schedules.pods import PodTarget
    from preheat.schedules.podwatch import PodWatcher, PodWatchers, kube_api

    namespaces = list(dict.fromkeys(namespace or []))
    if all_namespaces == bool(namespaces):
        raise ConfigError("give --namespace (repeatable) or --all-namespaces, not both and not neither")
    if any(not name.strip() for name in namespaces):
        raise ConfigError("--namespace must not be empty")

    target = PodTarget(
        endpoint=endpoint, worker_name=worker_name, port=port, port_name=port_name, templates=tuple(template or ())
    )
    catalog = load_catalog(get_settings().catalog)
    if endpoint:
        catalog.endpoint(endpoint)  # an unknown endpoint fails now, not at the first Ready pod
    for name in template or []:
        catalog.template(name)
    api = kube_api(kubeconfig, context)
    scopes = namespaces or [None]  # None: every namespace, through one cluster-wide watch
    watchers = PodWatchers([PodWatcher(api, scope, selector, target, settle_s=settle_s) for scope in scopes])
    prime_dispatch()
    _run_until_signalled(watchers)


def watch_workers(
    template: list[str] = typer.Option(None, "--template", "-t", help="Templates to warm (default: all)."),
    sweep_s: float = typer.Option(
        60.0, "--sweep-s", min=1.0, help="How often the worker registry is swept for starts no event announced."
    ),
) -> None:
    """Warm each Celery worker that comes online, unless its start-up warmup made it warm."""
    from preheat.celery.app import app
    from preheat.core.catalog import load_catalog
    from preheat.fleet.dispatch import prime_dispatch
    from preheat.schedules.online import WorkerOnlineWatcher

    catalog = load_catalog(get_settings().catalog)
    for name in template or []:
        catalog.template(name)
    prime_dispatch()
    _run_until_signalled(WorkerOnlineWatcher(app, templates=template or None, sweep_s=sweep_s))
