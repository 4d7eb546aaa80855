"""What `preheat bench load` concludes from its rows: each target of issue 37 (and of the
Celery mode), met or not, in one line each."""

from __future__ import annotations

import math

from preheat.cli.bench.chatclient import Row

CALLER_CORES_TARGET = 0.1  # what 16 callers' result wait may cost their process
# The targets, on the real model at one precision on both sides: against llama-server at 1
# and 16 users, and no step back against transformers' continuous batching.
PEER_TOKENS_TARGET = 1.0  # × llama-server's tokens/s, at 1 and at 16 users
TOKENS_TARGET = 2.6  # × transformers serve --continuous-batching, at 16 users
TTFT_P50_TARGETS = {16: 3.0, 32: 5.0}  # users: × the single user's TTFT p50, same server (reported)
TARGET_USERS = 16


def over_single(row: Row, rows: list[Row]) -> float | None:
    """The row's TTFT p50 over its server's single user's (closed 1 users), where measured:
    how much longer each user waits for the others (the target at 16 users is 3x)."""
    single = next((r for r in rows if r.mode == row.mode and r.load == "closed 1 users"), None)
    if single is None or not single.ttft_p50_ms or math.isnan(row.ttft_p50_ms):
        return None
    return row.ttft_p50_ms / single.ttft_p50_ms


def verdicts(rows: list[Row], skipped: dict[str, str]) -> list[str]:
    def at(mode: str, load: str) -> Row | None:
        return next((r for r in rows if r.mode == mode and r.load == load), None)

    lines, target = [], f"closed {TARGET_USERS} users"
    for row in (r for r in rows if r.mode == "celery" and r.client_p50_ms is not None):
        limit = 1.5 * row.worker_p50_ms + 20
        lines.append(
            f"preheat.infer, {row.load}: the caller waits {row.client_p50_ms:.1f} ms (p50) for the worker's "
            f"{row.worker_p50_ms:.1f} ms (target ≤ 1.5× + 20 ms = {limit:.1f}: {_met(row.client_p50_ms <= limit)})"
        )
        lines.append(
            f"preheat.infer, {row.load}: waiting took {row.caller_cores:.2f} of the caller's cores "
            f"(target ≤ {CALLER_CORES_TARGET}: {_met(row.caller_cores <= CALLER_CORES_TARGET)})"
        )
    for load in ("closed 1 users", target):
        ours, peer = at("batch", load), at("llama-server", load)
        if ours is None or peer is None:
            continue
        ratio = ours.tokens_per_s / peer.tokens_per_s if peer.tokens_per_s else float("inf")
        lines.append(
            f"tokens/s, {load}: {ours.tokens_per_s:.1f} vs llama-server {peer.tokens_per_s:.1f} = {ratio:.2f}× "
            f"(target ≥ {PEER_TOKENS_TARGET}: {_met(ratio >= PEER_TOKENS_TARGET)})"
        )
        lines.append(
            f"TTFT p50, {load}: {ours.ttft_p50_ms:.1f} ms vs llama-server {peer.ttft_p50_ms:.1f} ms "
            f"(target ≤ theirs: {_met(ours.ttft_p50_ms <= peer.ttft_p50_ms)})"
        )
        if load == target:
            lines.append(
                f"TTFT p99, {load}: {ours.ttft_p99_ms:.1f} ms vs llama-server {peer.ttft_p99_ms:.1f} ms "
                f"(target ≤ theirs: {_met(ours.ttft_p99_ms <= peer.ttft_p99_ms)})"
            )
    if "llama-server" in skipped:
        lines.append(f"llama-server not measured: {skipped['llama-server']}")
    ours, single = at("batch", target), at("batch", "closed 1 users")
    if ours is None:
        return [*lines, f"batch at {TARGET_USERS} users not measured: no verdict on the targets at that load"]
    if (theirs := at("transformers", target)) is not None:
        ratio = ours.tokens_per_s / theirs.tokens_per_s if theirs.tokens_per_s else float("inf")
        lines.append(
            f"tokens/s at {TARGET_USERS} users: {ours.tokens_per_s:.1f} vs transformers serve --continuous-batching "
            f"{theirs.tokens_per_s:.1f} = {ratio:.2f}× (target ≥ {TOKENS_TARGET}: {_met(ratio >= TOKENS_TARGET)})"
        )
        lines.append(
            f"TTFT p99 at {TARGET_USERS} users: {ours.ttft_p99_ms:.1f} ms vs {theirs.ttft_p99_ms:.1f} ms "
            f"(target ≤ theirs: {_met(ours.ttft_p99_ms <= theirs.ttft_p99_ms)})"
        )
    else:
        lines.append(f"transformers serve not measured ({skipped.get('transformers', 'not asked for')})")
    for users, target in TTFT_P50_TARGETS.items():
        if single is not None and (row := at("batch", f"closed {users} users")) is not None:
            ratio = row.ttft_p50_ms / single.ttft_p50_ms
            lines.append(
                f"TTFT p50 at {users} users: {row.ttft_p50_ms:.1f} ms = {ratio:.2f}× the single user's "
                f"{single.ttft_p50_ms:.1f} ms (target ≤ {target}: {_met(ratio <= target)})"
            )
    lines.append(
        f"ITL at {TARGET_USERS} users: p99 {ours.itl_p99_ms:.1f} ms, p50 {ours.itl_p50_ms:.1f} ms "
        "(a pre-fill rides in the decode steps: the p99 is a step with a chunk in it)"
    )
    if (alone := at("one-at-a-time", target)) is not None and alone.tokens_per_s:
        lines.append(
            f"batching vs one at a time at {TARGET_USERS} users: {ours.tokens_per_s / alone.tokens_per_s:.2f}×"
        )
    if (cold := at("no-prefix-cache", target)) is not None and cold.ttft_p50_ms:
        lines.append(
            f"prefix caching at {TARGET_USERS} users: TTFT p50 {ours.ttft_p50_ms:.1f} ms, "
            f"{cold.ttft_p50_ms:.1f} ms with it off"
        )
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"
