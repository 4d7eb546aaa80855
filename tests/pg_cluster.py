"""A PostgreSQL cluster of the test's own, on a free port, that checks passwords
(scram-sha-256): the shared server trusts every local connection, so it cannot show that a
password in a URL is sent, and sent right."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

from preheat.core import processes


def _bin_dir() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if not found:
        raise RuntimeError("initdb not found under /usr/lib/postgresql (.ci/run installs postgresql)")
    return found[-1].parent


class PrivatePostgres:
    user = "preheat"

    def __init__(self, password: str) -> None:
        self.password, self.port, self.bin = password, processes.free_port(), _bin_dir()
        # Not under pytest's tmp_path: the server runs as `postgres` when the tests run as
        # root (initdb refuses root), and root's pytest folders are closed to other users.
        self.folder = Path(tempfile.mkdtemp(prefix="preheat-pg-"))
        self._as_server_user = os.geteuid() == 0

    def url(self, password: str | None = None, database: str = "postgres") -> str:
        secret = quote(self.password if password is None else password, safe="")
        return f"postgresql+psycopg://{self.user}:{secret}@127.0.0.1:{self.port}/{database}"

    def start(self) -> PrivatePostgres:
        password_file = self.folder / "password"
        password_file.write_text(self.password)
        if self._as_server_user:
            shutil.chown(self.folder, "postgres", "postgres")
            shutil.chown(password_file, "postgres", "postgres")
        self._run(
            "initdb",
            "-D",
            str(self.folder / "data"),
            "-U",
            self.user,
            "--pwfile",
            str(password_file),
            "--auth-host=scram-sha-256",
            "--auth-local=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
        )
        password_file.unlink()
        self._run(
            "pg_ctl",
            "-D",
            str(self.folder / "data"),
            "-l",
            str(self.folder / "server.log"),
            "-w",
            "-o",
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )
        return self

    def stop(self) -> None:
        if (self.folder / "data" / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)

    def _run(self, tool: str, *args: str) -> None:
        argv = [str(self.bin / tool), *args]
        if self._as_server_user:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr[-2000:]}")
