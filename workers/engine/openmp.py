"""One OpenMP team in a process while it serves: the scheduler's.

torch runs its parallel CPU work (oneDNN's products, inductor's kernels, its own large ops) on
OpenMP. GNU libgomp, torch's OpenMP on Linux, gives every thread that starts parallel work a
team of threads of its own, kept for as long as that thread lives, and lets idle team threads
spin between two parallel regions only while the process's OpenMP threads are no more than
its cores. Past that, every parallel region of every team waits for its threads to be woken
from sleep. A thread that once ran a large torch op (a model's load on a benchmark's main
thread, the prefix store's writer copying a long prefix) and lives on is such a second team:
measured on 2 cores, the real model's bf16 decode step on the scheduler's thread took 24 ms at
one row and 49 ms at 16 rows alone, and 41 and 131 ms beside one idle team of another thread.

So a thread other than the scheduler's gives its team back when its torch work is done
(`release_team`); its next parallel op builds one again (tens of microseconds).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging

log = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp.h: omp_pause_soft


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), or None: another OpenMP runtime, or
    none loaded. Never loads one: a second copy would hold no team of torch's."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
            library.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return library
        except (OSError, AttributeError) as exc:  # an old libgomp, without OpenMP 5's pause
            log.info("OpenMP teams are not released (%s: %s)", path, exc)
    return None


def release_team() -> None:
    """The calling thread's OpenMP team given back (libgomp frees the calling thread's pool on
    `omp_pause_resource_all`); nothing where torch's OpenMP is not libgomp. Call it outside
    any parallel region, after a thread's torch work, on every thread but the scheduler's."""
    library = _libgomp()
    if library is not None:
        library.omp_pause_resource_all(_OMP_PAUSE_SOFT)


@contextlib.contextmanager
def team_released():
    """Torch work on a thread other than the scheduler's (a block, or a function it decorates):
    the thread's OpenMP team given back after it, whatever it raised."""
    try:
        yield
    finally:
        release_team()
