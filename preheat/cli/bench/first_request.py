"""`preheat bench first-request`: a fresh worker's first request against its steady state, gated vs ungated."""

from __future__ import annotations

from pathlib import Path

from preheat.cli.bench.common import host, prepare, write_report
from preheat.core.errors import ConfigError

FIRST_REQUEST_TARGET = 1.1  # first request TTFT / steady state, on a gated worker


def main(template: str, rounds: int, steady: int, timeout: float, json_path: Path) -> None:
    """The command (its options are declared in preheat.cli.bench): measure, print, write JSON."""
    from rich.table import Table

    from preheat.cli import render
    from preheat.cli.bench.fleet import first_request_round, summarise_first_requests

    console = render.console()
    settings, catalog = prepare(console, exclusive="bench first-request starts its own workers")
    name = template or next(iter(catalog.templates), None)
    if name is None:
        raise ConfigError(f"catalog {settings.catalog} has no template to request")
    spec = catalog.template(name)
    console.print(
        f"first request vs steady state, template {name!r} on {spec.model}: {rounds} round(s) × "
        "gated / ungated, a fresh worker each …"
    )
    measured = []
    for i in range(rounds):
        for gated in (True, False):
            measured.append(
                first_request_round(name, spec.probe, gated, steady, settings.home / "bench" / "logs", timeout)
            )
            console.print(
                f"  round {i + 1} {'gated' if gated else 'ungated'}: first "
                f"{measured[-1].first_ttft_ms:,.1f} ms, steady {measured[-1].steady_ttft_ms:,.1f} ms"
            )
    report = {
        "benchmark": "first-request",
        "template": name,
        "model": spec.model,
        "host": host(),
        "steady_requests": steady,
        **summarise_first_requests(measured, FIRST_REQUEST_TARGET),
    }
    table = Table(
        title=f"first request to a fresh worker vs steady state · {spec.model}, template {name}",
        title_justify="left",
        caption="TTFT in ms as the worker measures it (taking the request → first "
        "token); answered = seconds from the worker's launch to the answer, at the client",
        caption_justify="left",
    )
    for header in (
        "inference queue",
        "rounds",
        "first TTFT",
        "steady TTFT",
        "first/steady",
        "cached tokens",
        "answered after s",
    ):
        table.add_column(header, justify="left" if header == "inference queue" else "right")
    for row in report["rows"]:
        table.add_row(
            "gated (after warm)" if row["gated"] else "ungated (from start)",
            str(row["rounds"]),
            f"{row['first_ttft_ms']:,.1f}",
            f"{row['steady_ttft_ms']:,.1f}",
            f"{row['first_over_steady']:.2f}",
            f"{row['first_cached_tokens']:.0f}",
            f"{row['first_answered_s']:.1f}",
        )
    console.print(table)
    console.print(
        f"gated first/steady target ≤ {FIRST_REQUEST_TARGET}: {'met' if report['target']['met'] else 'NOT met'}"
    )
    write_report(report, json_path or settings.home / "bench" / "first-request.json", console)
