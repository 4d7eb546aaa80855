"""What the fault tests share: the worker's name, a long system prompt, and helpers that read
the history database and the worker's heartbeat."""

from __future__ import annotations

import subprocess

from sqlalchemy import select

from preheat.history.db import session_scope
from preheat.history.models import WarmupRun
from tests.conftest import PREHEAT_CLI

WORKER = "gpu0@faults-test"
# A system prompt of about 3,000 tokens: a long prefill for the tiny model.
HANDBOOK = " ".join(
    f"Rule {n}: a parcel late by {n % 7 + 2} working days is investigated, and the customer is "
    f"told the outcome within {n % 5 + 1} days."
    for n in range(85)
)


def _warm_and_wait(stack) -> subprocess.Popen:
    """`preheat warm --wait --json` in the background: it dispatches, then waits and reaps."""
    return subprocess.Popen(
        [PREHEAT_CLI, "warm", "--wait", "--json", "--timeout", "180"],
        env=stack.env,
        cwd=stack.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _latest_run_id():
    with session_scope() as session:
        return session.scalar(select(WarmupRun.id).order_by(WarmupRun.created_at.desc()).limit(1))


def _worker_ready() -> bool:
    return _worker_state().get("ready", False)


def _worker_state() -> dict:
    from preheat.fleet import registry

    with session_scope() as session:
        return next((record.state for record in registry.workers(session) if record.nodename == WORKER), {})
