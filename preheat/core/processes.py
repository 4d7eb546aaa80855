"""Start and stop real preheat processes (worker, beat, flower) on this machine.

Used by `preheat dev demo` and by the end-to-end tests, so both run exactly the commands
a deployment runs: ``celery -A preheat worker …`` and friends, as child processes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None


def free_port() -> int:
    """A local TCP port nothing listens on: free when asked (for a server to take), and
    refusing connections until something does (for a client to fail against)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def celery_command(*args: str) -> list[str]:
    # The celery script of this interpreter's environment, so a venv need not be activated.
    return [sys.executable, "-m", "celery", "-A", "preheat", *args]


def start(name: str, argv: list[str], env: dict[str, str], log_dir: Path, cwd: Path | None = None) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log_file:
        popen = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Proc(name, popen, log_path)


def worker_command(*args: str) -> list[str]:
    """`preheat-worker` of this interpreter's environment (preheat/worker_command.py)."""
    return [sys.executable, "-m", "preheat.celery.worker_command", *args]


def start_worker(nodename: str, env: dict[str, str], log_dir: Path, cwd: Path | None = None) -> Proc:
    argv = worker_command("--pool=threads", "-n", nodename, "--loglevel=INFO", "--without-gossip", "--without-mingle")
    return start(nodename.split("@")[0], argv, env, log_dir, cwd)


def wait_for_log(proc: Proc, text: str, timeout_s: float = 60.0) -> None:
    """Block until `text` appears in the process's log; fail with the log if it died or timed out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in proc.log():
            return
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()[-4000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"{proc.name} did not log {text!r} within {timeout_s:.0f} s:\n{proc.log()[-4000:]}")


def poll(check: Callable[[], object], timeout_s: float, every_s: float = 0.2, what: str = "the condition"):
    """Call `check` until it returns something truthy, and return that; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")


def health_url(proc: Proc, timeout_s: float = 60.0) -> str:
    """The worker's health server, as it logged it (PREHEAT_HEALTH_PORT=0 picks a free port)."""
    wait_for_log(proc, "health server on http://", timeout_s)
    port = re.search(r"health server on http://[^:]+:(\d+)", proc.log()).group(1)
    return f"http://127.0.0.1:{port}"


def start_serve(
    env: dict[str, str], log_dir: Path, name: str = "serve", host: str = "127.0.0.1", port: int = 0
) -> Proc:
    """`preheat serve` as its own process (port 0: a free one, see `serve_url`)."""
    preheat = str(Path(sys.executable).parent / "preheat")
    return start(name, [preheat, "serve", "--host", host, "--port", str(port)], env, log_dir)


def serve_url(proc: Proc, timeout_s: float = 60.0) -> str:
    """The server's root URL, as it logged it."""
    wait_for_log(proc, "preheat serve on http", timeout_s)
    scheme, port = re.search(r"preheat serve on (https?)://[^:]+:(\d+)", proc.log()).groups()
    return f"{scheme}://127.0.0.1:{port}"


def stop(proc: Proc, timeout_s: float = 15.0) -> int:
    """SIGTERM (Celery's warm shutdown), then SIGKILL the whole group if it hangs."""
    if proc.alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGTERM)
        try:
            proc.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()
    return proc.popen.returncode


def kill(proc: Proc) -> None:
    """SIGKILL the whole process group: a worker that dies without a word (OOM killer, node loss)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait()


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[tuple[Proc, ...]]:
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            stop(proc)
