"""The tables `preheat bench` prints, one per benchmark (the JSON beside each is its report)."""

from __future__ import annotations

from rich.table import Table

from preheat.cli.render import ms_cell


def ttft_table(report: dict) -> Table:
    """`preheat bench ttft`: one row per system prompt length."""
    model = report["model"]
    table = Table(
        title=f"TTFT with and without the cached prefix · {model['name']} ({model['architecture']}, "
        f"{model['parameters'] / 1e6:.1f} M params) on {report['device']}",
        title_justify="left",
        caption=f"ms, median of {report['repeats']} interleaved rounds; user input "
        f"{report['rows'][0]['user_tokens']} tokens; every prompt chat-templated (prefix = the rendered system turn); "
        "restore = the prefix read back from a prefix store; bare = no system prompt; overhead = "
        "lookup + id check + clone, as a share of warm",
        caption_justify="left",
    )
    headers = (
        "system tokens",
        "prefix tokens",
        "prefill",
        "restore",
        "TTFT cold",
        "TTFT warm",
        "TTFT bare",
        "saved",
        "warm/bare",
        "reuse",
        "overhead",
        "cache MiB",
        "same token",
    )
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    for row in report["rows"]:
        table.add_row(
            f"{row['system_tokens']:,}",
            f"{row['prefix_tokens']:,}",
            ms_cell(row["prefill_ms"]),
            ms_cell(row["restore_ms"]),
            ms_cell(row["ttft_cold_ms"]),
            ms_cell(row["ttft_warm_ms"]),
            ms_cell(row["ttft_bare_ms"]),
            f"{row['saved_pct']:.1f}%",
            f"{row['warm_over_bare']:.2f}",
            f"{row['reuse_ms']:.3f}",
            f"{row['reuse_overhead_pct']:.2f}%",
            f"{row['cache_bytes'] / 2**20:,.1f}",
            "yes" if row["same_first_token"] else "NO",
        )
    return table


def load_table(report: dict) -> Table:
    """`preheat bench load`: each server under the same load, side by side."""
    table = Table(
        title=f"many users at once, {report['shape']} dev model, max_tokens {report['max_tokens']}",
        title_justify="left",
        caption="closed N users: each sends its next request when its answer is complete; poisson: open-loop "
        "arrivals; TTFT = first content chunk at the client; ITL = gaps between content chunks",
        caption_justify="left",
    )
    headers = ("server", "load")
    numbers = (
        "requests",
        "errors",
        "TTFT p50 ms",
        "× 1 user",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "tokens/s",
        "req/s",
    )
    for header in (*headers, *numbers):
        table.add_column(header, justify="left" if header in headers else "right", no_wrap=True)
    for row in report["rows"]:
        table.add_row(
            row["mode"],
            row["load"],
            str(row["requests"]),
            str(row["errors"]),
            f"{row['ttft_p50_ms']:.1f}",
            "-" if row.get("ttft_p50_over_single") is None else f"{row['ttft_p50_over_single']:.2f}",
            f"{row['ttft_p99_ms']:.1f}",
            f"{row['itl_p50_ms']:.1f}",
            f"{row['itl_p99_ms']:.1f}",
            f"{row['tokens_per_s']:.1f}",
            f"{row['requests_per_s']:.2f}",
        )
    return table


def start_table(report: dict) -> Table:
    """`preheat bench start`: launch to first answer, stage by stage, against the limit."""
    table = Table(
        title="worker start-up, stage by stage, against the limit measured in this run",
        title_justify="left",
        caption=f"seconds from launch, median of {report['rounds']} launch(es) and limit(s), one of each per round; "
        "limit = interpreter, + a worker's "
        "imports + reading the weight files (resident), + the pre-fill itself (prefixes); compile = the worker's own "
        "figure for its steps compiled or restored (between resident and prefixes); stop = SIGTERM to exit, idle",
        caption_justify="left",
    )
    headers = ("model", "prefix store", "steps", "first log", "resident", "compile", "prefixes", "ready", "answered")
    for header in (*headers, "stop", "pre-fills", "ready/limit"):
        table.add_column(header, justify="left" if header in headers[:3] else "right", no_wrap=True)
    for shape, limit in report["limits"].items():
        # The limit of each stage: what must have happened by then, at the least.
        resident = limit["interpreter_s"] + limit["imports_s"] + limit["read_s"]
        table.add_row(
            shape,
            "limit",
            "-",
            f"{limit['interpreter_s']:.2f}",
            f"{resident:.2f}",
            "-",
            f"{resident + limit['prefill_s']:.2f}",
            f"{limit['total_s']:.2f}",
            "-",
            "-",
            "-",
            "1.00",
        )
        for row in (r for r in report["rows"] if r["shape"] == shape):
            table.add_row(
                shape,
                row["store"],
                row["steps"] if row["steps"] == "eager" else f"{row['steps']} ({row['compiled']})",
                *(f"{row[k]:.2f}" for k in ("first_log_s", "resident_s", "compile_s", "prefixes_s", "ready_s")),
                f"{row['answered_s']:.2f}",
                f"{row['stop_s']:.2f}",
                str(row["prefills"]),
                f"{row['ready_over_limit']:.2f}",
            )
    return table


def sleep_bench_table(report: dict) -> Table:
    """`preheat bench sleep`: a sleep and a wake per level against the cold start and steady."""
    table = Table(
        title=f"{report['shape']}: asleep and woken against a cold start (launch → ready "
        f"{report['cold_start_s']:.2f} s) and steady TTFT ({report['steady_ttft_ms']:.1f} ms)",
        title_justify="left",
        caption=f"median of {report['rounds']} round(s); RSS freed = the worker's resident set before the sleep "
        "minus after, over the weight bytes; wake → ready = `preheat wake` sent to /health/ready 200; first = the "
        "first request after the wake's run; at ready = one sent the moment it is ready, beside the wake's probes",
        caption_justify="left",
    )
    headers = (
        "level",
        "sleep ms",
        "weights MiB",
        "RSS freed",
        "wake ms",
        "restore ms",
        "wake → ready s",
        "× cold",
        "first TTFT ms",
        "× steady",
        "at ready ms",
        "× steady ",
    )
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    for row in report["summary"]:
        table.add_row(
            str(row["level"]),
            f"{row['sleep_ms']:.0f}",
            f"{row['weight_bytes'] / 2**20:,.1f}",
            f"{100 * row['rss_freed_over_weights']:.0f}%",
            f"{row['wake_ms']:.0f}",
            ms_cell(row["restore_ms"]),
            f"{row['wake_ready_s']:.2f}",
            f"{row['wake_over_cold']:.2f}",
            f"{row['first_request_ttft_ms']:.1f}",
            f"{row['first_over_steady']:.2f}",
            f"{row['at_ready_ttft_ms']:.1f}",
            f"{row['at_ready_over_steady']:.2f}",
        )
    return table


def turn_two_table(report: dict) -> Table:
    """`preheat bench ttft`: a conversation's second turn, with and without turn one cached."""
    row = report["turn_two"]
    table = Table(
        title="Turn two of a conversation (chat-templated), side by side",
        title_justify="left",
        caption=f"ms, median of {report['repeats']} interleaved rounds",
        caption_justify="left",
    )
    for header in ("system tokens", "turn-one tokens", "turn-two tokens", "cached", "TTFT", "same token"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("what is cached", justify="left")
    same = "yes" if row["same_first_token"] else "NO"
    table.add_row(
        f"{row['system_tokens']:,}",
        f"{row['turn_one_tokens']:,}",
        f"{row['turn_two_tokens']:,}",
        f"{row['cached_with_turn_one']:,}",
        ms_cell(row["ttft_with_turn_one_ms"]),
        same,
        "system prompt + turn one (remembered)",
    )
    table.add_row(
        f"{row['system_tokens']:,}",
        f"{row['turn_one_tokens']:,}",
        f"{row['turn_two_tokens']:,}",
        f"{row['cached_prefix_only']:,}",
        ms_cell(row["ttft_prefix_only_ms"]),
        same,
        "system prompt only",
    )
    return table


def restart_table(report: dict) -> Table:
    """`preheat bench load --restart`: each server started again, and its first request."""
    table = Table(
        title="restarted: the first request on a system prompt held before the restart",
        title_justify="left",
        caption="ready = process start to ready (llama-server: and its slot restored); cached = prompt tokens the "
        "server says came from its cache; restored = preheat: prefixes read from its store, llama-server: tokens",
        caption_justify="left",
    )
    for header in ("server", "kept across", "ready s", "TTFT ms", "prompt", "cached", "restored", "error"):
        table.add_column(header, justify="left" if header in ("server", "kept across", "error") else "right")
    for row in report["restart"]:
        table.add_row(
            row["server"],
            row["restore"],
            f"{row['ready_s']:.2f}",
            "-" if row["ttft_ms"] is None else f"{row['ttft_ms']:.1f}",
            *("-" if row[k] is None else f"{row[k]:g}" for k in ("prompt_tokens", "cached_tokens", "restored")),
            row["error"] or "",
        )
    return table
