"""Secrets: a password-protected Postgres URL from the environment or a file, never written
where people read."""

from __future__ import annotations

import subprocess
import uuid
from urllib.parse import quote

import pytest

from tests.conftest import PREHEAT_CLI

pytestmark = pytest.mark.slow


def test_a_password_protected_postgres_url_works_from_the_environment_or_a_file(embedded_stack, tmp_path):
    """A cluster of our own that checks passwords (scram-sha-256); the password has URL
    characters in it, and '%', which Alembic's config would read as interpolation."""
    from tests.pg_cluster import PrivatePostgres

    stack = embedded_stack
    password = f"p@ss:w/rd%{uuid.uuid4().hex[:8]}"
    server = PrivatePostgres(password).start()
    try:
        by_env = {**stack.env, "PREHEAT_DATABASE_URL": server.url()}
        upgraded = subprocess.run(
            [PREHEAT_CLI, "db", "upgrade"], env=by_env, capture_output=True, text=True, timeout=120
        )
        assert upgraded.returncode == 0, upgraded.stderr

        # The same URL from a file (a mounted Kubernetes Secret), not the environment.
        secrets = tmp_path / "secrets"
        secrets.mkdir()
        (secrets / "preheat_database_url").write_text(server.url() + "\n")
        by_file = {**stack.env, "PREHEAT_SECRETS_DIR": str(secrets)}
        current = subprocess.run([PREHEAT_CLI, "db", "check"], env=by_file, capture_output=True, text=True, timeout=120)
        assert current.returncode == 0, current.stdout + current.stderr  # connected, migrated, no drift
        listed = subprocess.run([PREHEAT_CLI, "history"], env=by_file, capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr

        # A wrong password: one line, the services' exit code, and no password shown.
        wrong = subprocess.run(
            [PREHEAT_CLI, "history"],
            env={**stack.env, "PREHEAT_DATABASE_URL": server.url(password + "x")},
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = wrong.stdout + wrong.stderr
        assert wrong.returncode == 5 and "password authentication failed" in said, said
        assert len(said.strip().splitlines()) == 1
        for shown in (upgraded, current, listed, wrong):
            assert password not in shown.stdout + shown.stderr
            assert quote(password, safe="") not in shown.stdout + shown.stderr
        missing = subprocess.run(
            [PREHEAT_CLI, "history"],
            env={**stack.env, "PREHEAT_SECRETS_DIR": "/nonexistent"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert missing.returncode == 2 and "PREHEAT_SECRETS_DIR" in missing.stdout + missing.stderr
    finally:
        server.stop()
