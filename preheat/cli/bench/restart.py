"""The restart rows of `preheat bench load --restart`: each server stopped and started again,
then its first request on a system prompt it held before the restart.

- preheat: `preheat serve` with a prefix store of the bench's own. The first start pre-fills
  the templates and writes their prefixes; the second reads them back before it is ready.
- llama-server with `--slot-save-path`: the first start answers a request on the system
  prompt and saves that slot (`POST /slots/0?action=save`); the second restores it
  (`?action=restore`) before it counts as ready.
- llama-server started again without the restore, beside it: what the saved slot is worth.

Each row: seconds from the process's start to ready (preheat: `/health/ready`; llama-server:
`/health`, then the restore), the first request's TTFT at the client (streamed, as in the
load), and the prompt tokens the server itself says came from its cache
(`usage.prompt_tokens_details.cached_tokens`, which both servers send), with preheat's count
of prefixes read from its store (`preheat_prefix_restores_total`).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SERVERS = ("batch", "llama-server")  # the --modes a restart row is measured for
SLOT_FILE = "restart.bin"


@dataclass
class RestartRow:
    server: str
    restore: str  # what the second start had of the first: prefix store | saved slot | nothing
    ready_s: float = 0.0
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    restored: float | None = None  # preheat: prefixes read from the store; llama-server: tokens restored
    error: str | None = None


def rows(modes: list[str], setup, templates, catalog, folder: Path, python: Path, timeout: float, max_tokens: int):
    """The restart rows of the `--modes` that have one, each a first and a second start."""
    system_prompt = catalog.system_prompt(templates[0])
    measured = []
    if "batch" in modes:
        measured.append(_preheat(setup, templates, catalog, folder, system_prompt, timeout, max_tokens))
    if "llama-server" in modes:
        import httpx

        try:
            measured += _llama_server(setup, folder, python, system_prompt, timeout, max_tokens)
        except (RuntimeError, OSError, subprocess.SubprocessError, httpx.HTTPError) as exc:  # not built, not up, gone
            measured.append(RestartRow("llama-server", "saved slot", error=f"{type(exc).__name__}: {exc}"))
    return measured


def _preheat(setup, templates, catalog, folder: Path, system_prompt: str, timeout: float, max_tokens: int):
    import httpx

    from preheat.cli.bench import servers

    # The load's compile cache (its graphs restored, as the load's own start left them) and a
    # prefix store of the restart's: the first start writes it, the second reads it.
    store = folder / "restart" / "prefixes"
    shutil.rmtree(store, ignore_errors=True)
    start = functools.partial(servers.start_preheat, "batch", setup, templates, catalog, folder, timeout, store)
    first = start(log_name="serve-batch-before-restart")
    first.stop()  # a stop lets the store's writer finish
    began = time.perf_counter()
    server = start(log_name="serve-batch-restarted")
    ready_s = time.perf_counter() - began
    try:
        row = _first_request(server.url, server.model, system_prompt, max_tokens, "batch", "prefix store", ready_s)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        found = re.findall(r"^preheat_prefix_restores_total\{[^}]*\} (\S+)$", metrics, re.M)
        row.restored = sum(float(value) for value in found)
    finally:
        server.stop()
    return row


def _llama_server(setup, folder: Path, python: Path, system_prompt: str, timeout: float, max_tokens: int):
    import httpx

    from preheat.cli.bench import llamacpp
    from preheat.cli.bench.chatclient import new_client, user_turn

    saved = folder / "restart" / "slots"
    shutil.rmtree(saved, ignore_errors=True)
    peer_folder = folder / "llama.cpp"
    first = llamacpp.start(peer_folder, setup.model_dir, setup.dtype, setup.rows, timeout, saved, python)
    try:
        with new_client(timeout) as client:
            # Slot 0 answers the request that fills it, then is saved (the restart keeps it).
            primed = _chat_in_slot(client, first.url, system_prompt, user_turn(0), max_tokens)
            if primed.error is None:
                done = client.post(f"{first.url}/slots/0", params={"action": "save"}, json={"filename": SLOT_FILE})
                if done.status_code != 200:
                    primed.error = f"saving slot 0 answered {done.status_code}: {done.text[:200]}"
    finally:
        first.stop()
    if primed.error is not None:
        return [RestartRow("llama-server", "saved slot", error=primed.error)]
    measured = []
    for restore in ("saved slot", "nothing"):
        began = time.perf_counter()
        server = llamacpp.start(peer_folder, setup.model_dir, setup.dtype, setup.rows, timeout, saved, python)
        try:
            tokens = None
            if restore == "saved slot":
                done = httpx.post(
                    f"{server.url}/slots/0", params={"action": "restore"}, json={"filename": SLOT_FILE}, timeout=timeout
                )
                if done.status_code != 200:
                    error = f"restoring slot 0 answered {done.status_code}: {done.text[:200]}"
                    measured.append(RestartRow("llama-server", restore, error=error))
                    continue
                tokens = done.json().get("n_restored")
            ready_s = time.perf_counter() - began
            row = _first_request(server.url, "model", system_prompt, max_tokens, "llama-server", restore, ready_s)
            row.restored = tokens
            measured.append(row)
        finally:
            server.stop()
    return measured


def _first_request(url, model, system_prompt, max_tokens, server, restore, ready_s) -> RestartRow:
    from preheat.cli.bench.chatclient import chat, new_client, user_turn

    with new_client() as client:
        answer = chat(client, url, model, system_prompt, user_turn(1), max_tokens)
    ttft = None if answer.ttft_s is None else answer.ttft_s * 1000
    return RestartRow(server, restore, ready_s, ttft, answer.prompt_tokens, answer.cached_tokens, error=answer.error)


def _chat_in_slot(client, url: str, system_prompt: str, user_input: str, max_tokens: int):
    """A chat request pinned to slot 0 (llama-server's `id_slot`), so that slot is the one saved."""
    from preheat.cli.bench.chatclient import chat

    return chat(client, url, "model", system_prompt, user_input, max_tokens, extra={"id_slot": 0})


def verdicts(measured: list[RestartRow]) -> list[str]:
    """preheat's restart beside llama-server's restored slot: ready, and the first token."""
    ours = next((r for r in measured if r.server == "batch" and r.error is None), None)
    peer = next((r for r in measured if r.restore == "saved slot" and r.error is None), None)
    lines = [f"restart, {r.server} ({r.restore}): {r.error}" for r in measured if r.error is not None]
    if ours is not None and peer is not None:
        lines.append(
            f"restart: ready in {ours.ready_s:.2f} s vs llama-server {peer.ready_s:.2f} s (slot restored); first "
            f"request TTFT {ours.ttft_ms:.1f} ms vs {peer.ttft_ms:.1f} ms; cached prompt tokens "
            f"{ours.cached_tokens} of {ours.prompt_tokens} vs {peer.cached_tokens} of {peer.prompt_tokens}"
        )
    return lines
