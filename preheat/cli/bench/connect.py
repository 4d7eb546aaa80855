"""`preheat bench connect`: what a pre-opened pool saves on a model server's first request.

Against a real `preheat serve` over TLS on loopback (a CA made for the run), three ways to
send the same streamed request, interleaved round after round so drift hits them alike:
- fresh: a new client, as code that connects on demand does: TCP + TLS handshake first;
- pre-opened: a new pool whose connection was established ahead (untimed), then the first
  request through it;
- steady: a request on a long-lived pool whose connection has served requests before.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from preheat.cli.bench.common import host, prepare, write_report
from preheat.core import processes
from preheat.core.catalog import Catalog, EndpointSpec
from preheat.core.errors import ConfigError
from preheat.endpoints.pools import EndpointPool, build_client, chat_body, stream_chat


def make_tls(folder: Path) -> dict[str, Path]:
    """A throw-away CA and a certificate for 127.0.0.1 signed by it."""
    import trustme

    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: folder / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    return paths


@dataclass(frozen=True)
class ConnectReport:
    rounds: int
    fresh_ms: float
    preopened_ms: float
    steady_ms: float
    establish_ms: float  # opening the pre-opened pool's connection, paid before the request

    @property
    def preopened_over_steady(self) -> float:
        return self.preopened_ms / self.steady_ms

    @property
    def fresh_over_steady(self) -> float:
        return self.fresh_ms / self.steady_ms


def measure(spec: EndpointSpec, catalog: Catalog, template: str, model: str, rounds: int) -> ConnectReport:
    """Back to back, each round starting with another way; the same primer (a one-token
    request of the measured shape) opens both pools, so the server has just served the
    same kind of request before every timed one."""
    spec = spec.model_copy(update={"min_connections": 1, "max_connections": 1, "keepalive_expiry_s": 300})
    system, probe = catalog.system_prompt(template), catalog.template(template).probe

    def ask(pool: EndpointPool) -> float:
        return stream_chat(pool, model, system, probe, 1).ttft_ms

    def fresh() -> float:
        pool = EndpointPool("fresh", spec, build_client("fresh", spec))
        try:
            return ask(pool)
        finally:
            pool.close()

    establish: list[float] = []

    primer = chat_body(model, system, probe, 1)  # what primer_for sends for this template

    def preopened() -> float:
        pool = EndpointPool("preopened", spec, build_client("preopened", spec))
        try:
            establish.append(pool.establish(primer))
            return ask(pool)
        finally:
            pool.close()

    steady_pool = EndpointPool("steady", spec, build_client("steady", spec))
    steady_pool.establish(primer)
    ask(steady_pool)  # the server's first request of the run, and the pool's, happen here
    ways = {"fresh": fresh, "preopened": preopened, "steady": lambda: ask(steady_pool)}
    runs: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways)
    try:
        for i in range(rounds):
            # Each round starts with another way, so none always follows the same one.
            for name in order[i % 3 :] + order[: i % 3]:
                runs[name].append(ways[name]())
    finally:
        steady_pool.close()
    return ConnectReport(
        rounds,
        statistics.median(runs["fresh"]),
        statistics.median(runs["preopened"]),
        statistics.median(runs["steady"]),
        statistics.median(establish),
    )


def run(catalog: Catalog, template: str, rounds: int, http2: bool, folder: Path, timeout_s: float) -> ConnectReport:
    tls = make_tls(folder / "tls")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PREHEAT_SERVE_TLS_CERT": str(tls["cert"]),
        "PREHEAT_SERVE_TLS_KEY": str(tls["key"]),
    }
    env.pop("PREHEAT_SERVE_API_KEY", None)
    server = processes.start_serve(env, folder / "logs", name="bench-serve")
    with processes.running(server):
        url = processes.serve_url(server, timeout_s)
        import ssl

        trust = ssl.create_default_context(cafile=str(tls["ca"]))
        processes.poll(lambda: _ready(url, trust), timeout_s, 0.2, "preheat serve ready")
        time.sleep(0.5)  # let the server's start-up work settle before the first timed round
        spec = EndpointSpec(base_url=f"{url}/v1", kind="preheat", ca_bundle=str(tls["ca"]), http2=http2)
        return measure(spec, catalog, template, catalog.template(template).model, rounds)


def _ready(url: str, trust) -> bool:
    try:
        return httpx.get(f"{url}/health/ready", verify=trust, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


CONNECT_TARGET = 1.2  # first request through a pre-opened pool / steady state


def main(template: str, endpoint: str, rounds: int, http2: bool, timeout: float, json_path: Path) -> None:
    """The command (its options are declared in preheat.cli.bench): measure, print, write JSON."""
    from rich.table import Table

    from preheat.cli import render

    def template_of(catalog):
        spec = catalog.endpoint(endpoint) if endpoint else None
        return template or (spec.templates[0] if spec and spec.templates else next(iter(catalog.templates), None))

    def known_names(settings, catalog) -> None:
        if template_of(catalog) is None:
            raise ConfigError(f"catalog {settings.catalog} has no template to request")
        catalog.template(template_of(catalog))

    console = render.console()
    # Against a catalog endpoint nothing local runs: no dev model is built.
    settings, catalog = prepare(console, database=False, models=not endpoint, validate=known_names)
    spec = catalog.endpoint(endpoint) if endpoint else None
    name = template_of(catalog)
    target = f"endpoint {endpoint} ({spec.base_url})" if spec else "preheat serve over TLS on loopback"
    console.print(f"first request through a connection pool · {target}, template {name!r}, {rounds} rounds …")
    if spec:
        report = measure(
            spec.model_copy(update={"http2": http2 or spec.http2}),
            catalog,
            name,
            spec.model or catalog.template(name).model,
            rounds,
        )
    else:
        report = run(catalog, name, rounds, http2, settings.home / "bench", timeout)
    table = Table(
        title="TTFT of a streamed request over TLS: fresh client vs pre-opened pool vs steady state",
        title_justify="left",
        caption=f"ms, client-side (request → first token), median of {rounds} "
        "interleaved rounds; pre-opened paid its connection ahead",
        caption_justify="left",
    )
    for header in ("way", "TTFT ms", "× steady"):
        table.add_column(header, justify="left" if header == "way" else "right")
    table.add_row(
        "fresh client (TCP + TLS on the request)", f"{report.fresh_ms:,.2f}", f"{report.fresh_over_steady:.2f}"
    )
    table.add_row(
        "pre-opened pool, first request", f"{report.preopened_ms:,.2f}", f"{report.preopened_over_steady:.2f}"
    )
    table.add_row("steady state (a connection that served before)", f"{report.steady_ms:,.2f}", "1.00")
    console.print(table)
    met = report.preopened_over_steady <= CONNECT_TARGET
    console.print(
        f"opening the pool's connection ahead took {report.establish_ms:,.2f} ms; pre-opened / steady "
        f"target ≤ {CONNECT_TARGET}: {'met' if met else 'NOT met'}"
    )
    write_report(
        {
            "benchmark": "connect",
            "template": name,
            "measured_against": target,
            "host": host(),
            "http2_offered": http2,
            "rounds": rounds,
            "fresh_ms": report.fresh_ms,
            "preopened_ms": report.preopened_ms,
            "steady_ms": report.steady_ms,
            "establish_ms": report.establish_ms,
            "fresh_over_steady": report.fresh_over_steady,
            "preopened_over_steady": report.preopened_over_steady,
            "target": {"preopened_over_steady": f"<= {CONNECT_TARGET}", "met": met},
        },
        json_path or settings.home / "bench" / "connect.json",
        console,
    )
