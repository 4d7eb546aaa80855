"""A process held to a share of one CPU, as a Kubernetes CPU limit holds a container.

Where the cgroup v1 cpu controller is writable (these machines and CI), the process is put
in a cgroup of its own with a CFS quota: the kernel stops it once it has used its share of
each period, exactly as a container's `resources.limits.cpu` does. Elsewhere a thread stops
and continues it (SIGSTOP/SIGCONT) at the same duty cycle, which is coarser but still slows
it several-fold.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # short periods: a probe of ~10 ms meets the quota, not a lucky gap


@contextlib.contextmanager
def cpu_share(pid: int, share: float) -> Iterator[str]:
    """Hold `pid` (all its threads) to `share` of one CPU; yields how ("cgroup" or "signals")."""
    group = CPU_CGROUP / f"preheat-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError:
        with _signalled(pid, share):
            yield "signals"
        return
    try:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * share)))
        (group / "cgroup.procs").write_text(str(pid))  # v1 moves every thread of the process
        yield "cgroup"
    finally:
        with contextlib.suppress(OSError):
            (CPU_CGROUP / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            group.rmdir()


@contextlib.contextmanager
def _signalled(pid: int, share: float) -> Iterator[None]:
    stop, period_s = threading.Event(), PERIOD_US / 1e6

    def duty_cycle() -> None:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(period_s * (1 - share))
            os.kill(pid, signal.SIGCONT)
            time.sleep(period_s * share)

    thread = threading.Thread(target=duty_cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        os.kill(pid, signal.SIGCONT)
