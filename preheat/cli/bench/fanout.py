"""`preheat bench fanout`: one warmup to N fresh workers, against the slowest single worker."""

from __future__ import annotations

from pathlib import Path

from preheat.cli.bench.common import host, prepare, worker_counts, write_report

FANOUT_TARGET = 1.2  # fleet warmup time / the slowest single worker's


def main(workers: str, rounds: int, template: list[str], timeout: float, json_path: Path) -> None:
    """The command (its options are declared in preheat.cli.bench): measure, print, write JSON."""
    from rich.table import Table

    from preheat.cli import render
    from preheat.cli.bench.fleet import fanout_round, median_fanout

    console = render.console()
    counts = worker_counts(workers)
    settings, catalog = prepare(console, exclusive="bench fanout starts its own workers")
    for name in template or []:
        catalog.template(name)  # unknown names fail before any worker starts
    rows = []
    for count in counts:
        measured = []
        for i in range(rounds):
            measured.append(fanout_round(count, template or None, settings.home / "bench" / "logs", timeout))
            console.print(
                f"  {count} worker(s), round {i + 1}: {measured[-1].total_s:.2f} s in all, slowest "
                f"worker {measured[-1].slowest_worker_s:.2f} s"
            )
        rows.append(median_fanout(measured))
    met = all(row.total_over_slowest <= FANOUT_TARGET for row in rows)
    report = {
        "benchmark": "fanout",
        "host": host(),
        "templates": template or list(catalog.templates),
        "rounds": rounds,
        "rows": [{**vars(row), "total_over_slowest": row.total_over_slowest} for row in rows],
        "target": {"total_over_slowest": f"<= {FANOUT_TARGET}", "met": met},
    }
    table = Table(
        title="one warmup to N workers: total vs the slowest single worker",
        title_justify="left",
        caption=f"median of {rounds} round(s); total = dispatch to every job final in history; slowest = "
        "the longest any one worker spent on its jobs",
        caption_justify="left",
    )
    for header in ("workers", "total s", "slowest worker s", "total/slowest", "jobs"):
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(
            str(row.workers),
            f"{row.total_s:.2f}",
            f"{row.slowest_worker_s:.2f}",
            f"{row.total_over_slowest:.2f}",
            ", ".join(f"{n} {s}" for s, n in sorted(row.statuses.items())),
        )
    console.print(table)
    console.print(f"total/slowest target ≤ {FANOUT_TARGET}: {'met' if met else 'NOT met'}")
    write_report(report, json_path or settings.home / "bench" / "fanout.json", console)
