"""A worker's start-up heap: Python's cyclic collector held off while the worker builds it, then
frozen.

A worker's start builds a heap that lives as long as the worker does (its modules: Celery,
SQLAlchemy, torch, transformers; the model's modules and parameters; the tokenizer) and leaves
little garbage behind. The cyclic collector's full passes during that start walk everything
built so far and find almost nothing: measured on 2 cores with SmolLM2-135M, eight full passes
cost the worker's imports and its model's load 1.2-1.5 s of 5.9-6.5 s. So the collector is held
off from the process's first line (`hold_collector`) until the models are resident
(`start_built`); then `gc.freeze()` moves the heap where later passes never walk it, and the
collector runs again: a compile, a pre-fill and serving collect their own garbage, and a pass
no longer walks the model's hundreds of thousands of objects (vLLM freezes its heap after its
start for the same reason).

Frozen without a pass first: the pass would find what the start left unreachable in cycles,
13 thousand small objects (tuples, cells, functions, frames; no tensor; about 8 MB) of 700
thousand, and cost 0.37-0.55 s of the start on 2 cores (docs/benchmarks.md). Refcounting still
frees any frozen object whose last reference goes; only that start's cyclic garbage is kept,
once, for the worker's life.

Only a process that held the collector lets it go: where a test or an embedding program drives
a worker's runtime, `start_built` does nothing.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_held = [False]  # whether this process's collector is held by hold_collector, not let go yet


def hold_collector() -> None:
    """The cyclic collector off until `start_built`: first thing in a worker process. Nothing
    where it is already off (the process's owner turned it off, and keeps it so)."""
    with _lock:
        if gc.isenabled():
            gc.disable()
            _held[0] = True


def start_built() -> None:
    """Where the worker's start-up heap is built (its models resident, or given up): the heap
    frozen, the collector on again. Once; nothing in a process that did not hold the collector."""
    with _lock:
        if not _held[0]:
            return
        _held[0] = False
        try:
            gc.freeze()
        finally:
            gc.enable()
    # Not counted: gc.get_freeze_count() walks every frozen object, 50 ms of a 135 M model's
    # start on 2 cores (700 thousand objects, scattered through memory).
    log.info("start-up heap: frozen, the collector on again")


@contextlib.contextmanager
def building():
    """A block that builds the start-up heap (a worker's models made resident): `start_built`
    after it, whatever it raised."""
    try:
        yield
    finally:
        start_built()
