"""Bad input, table-driven, through the real `preheat` entry point (a process each): every
row exits non-zero with one line that names what is wrong, and no table changes."""

from __future__ import annotations

import subprocess

import pytest
from sqlalchemy import MetaData, func, select

from tests.conftest import PREHEAT_CLI, write_catalog

CRON = "0 9 * * *"
LONG_CRON = ",".join(str(m) for m in range(60)) + " 9 * * *"  # 171 characters of a valid cron

# (name, arguments, environment, prompt file contents or None, expected exit, expected text)
ROWS = [
    # Settings
    ("dead-after inf", ["config", "check"], {"PREHEAT_WORKER_DEAD_AFTER_S": "inf"}, None, 2, "finite number"),
    ("dead-after 1e300", ["config", "check"], {"PREHEAT_WORKER_DEAD_AFTER_S": "1e300"}, None, 2, "less than or equal"),
    ("dead-after nan", ["config", "check"], {"PREHEAT_WORKER_DEAD_AFTER_S": "nan"}, None, 2, "finite number"),
    ("heartbeat negative", ["config", "check"], {"PREHEAT_HEARTBEAT_INTERVAL_S": "-1"}, None, 2, "greater than 0"),
    ("db timeout zero", ["config", "check"], {"PREHEAT_DB_TIMEOUT_S": "0"}, None, 2, "PREHEAT_DB_TIMEOUT_S"),
    ("lost-message bound", ["config", "check"], {"PREHEAT_LOST_MESSAGE_AFTER_S": "1"}, None, 2, "at least twice"),
    ("lease 1e300", ["config", "check"], {"PREHEAT_BEAT_LEASE_S": "1e300"}, None, 2, "PREHEAT_BEAT_LEASE_S"),
    ("catalog a directory", ["config", "check"], {"PREHEAT_CATALOG": "/tmp"}, None, 2, "is a directory"),
    ("catalog missing", ["config", "check"], {"PREHEAT_CATALOG": "/no/such.toml"}, None, 2, "does not exist"),
    ("home unusable", ["history"], {"PREHEAT_HOME": "/proc/no-such-home"}, None, 2, "cannot use /proc/no-such-home"),
    ("device", ["config", "check"], {"PREHEAT_DEVICE": "tpu"}, None, 2, "PREHEAT_DEVICE"),
    ("probe repeats", ["config", "check"], {"PREHEAT_PROBE_REPEATS": "0"}, None, 2, "PREHEAT_PROBE_REPEATS"),
    ("broker url", ["config", "check"], {"PREHEAT_BROKER_URL": "redis:/nohost"}, None, 2, "has no host"),
    # Options and arguments: one line naming the option, never a usage box
    ("timeout 0", ["warm", "--timeout", "0"], {}, None, 2, "Invalid value for '--timeout'"),
    ("limit 0", ["history", "--limit", "0"], {}, None, 2, "Invalid value for '--limit'"),
    ("status bogus", ["history", "--status", "bogus"], {}, None, 2, "Invalid value for '--status'"),
    ("trigger bogus", ["history", "--trigger", "bogus"], {}, None, 2, "Invalid value for '--trigger'"),
    ("since overflow", ["history", "--since", "9999999999d"], {}, None, 2, "reaches back before year 1"),
    ("since words", ["history", "--since", "yesterday"], {}, None, 2, "expected e.g. 30m"),
    ("no such command", ["warmup"], {}, None, 2, "No such command 'warmup'"),
    ("missing argument", ["infer"], {}, None, 2, "Missing argument"),
    ("unknown option", ["warm", "--fast"], {}, None, 2, "No such option: --fast"),
    ("requested-by long", ["warm", "--requested-by", "x" * 201], {}, None, 2, "at most 200"),
    ("requested-by empty", ["warm", "--requested-by", ""], {}, None, 2, "--requested-by must not be empty"),
    ("unknown template", ["warm", "-t", "nope"], {}, None, 2, "unknown template 'nope'"),
    ("infer unknown", ["infer", "nope", "hi"], {}, None, 2, "unknown template 'nope'"),
    ("infer too hot", ["infer", "support", "hi", "--temperature", "5"], {}, None, 2, "--temperature: must be in"),
    ("infer top-p 0", ["infer", "support", "hi", "--top-p", "0"], {}, None, 2, "--top-p: must be in (0, 1]"),
    ("infer empty stop", ["infer", "support", "hi", "--stop", ""], {}, None, 2, "--stop: must be a string"),
    # Schedules
    ("cron too long", ["schedule", "add", "s", "--cron", LONG_CRON], {}, None, 2, "at most 120"),
    ("full-width digit", ["schedule", "add", "s", "--cron", "\uff15 * * * *"], {}, None, 2, "is invalid"),
    ("empty tz", ["schedule", "add", "s", "--cron", CRON, "--tz", ""], {}, None, 2, "must not be empty"),
    ("unknown tz", ["schedule", "add", "s", "--cron", CRON, "--tz", "Mars/Base"], {}, None, 2, "unknown time zone"),
    ("bad name", ["schedule", "add", "bad name", "--cron", CRON], {}, None, 2, "schedule name 'bad name'"),
    ("worker with space", ["schedule", "add", "s", "--cron", CRON, "-w", "gpu 0@h"], {}, None, 2, "nodename"),
    ("four fields", ["schedule", "add", "s", "--cron", "0 9 * *"], {}, None, 2, "must have 5 fields"),
    ("minute 61", ["schedule", "add", "s", "--cron", "61 * * * *"], {}, None, 2, "is invalid"),
    ("lead a week", ["schedule", "add", "s", "--cron", CRON, "--lead", "604800"], {}, None, 2, "lead time"),
    ("never fires", ["schedule", "add", "s", "--cron", "0 0 30 2 *"], {}, None, 2, "is invalid"),
    ("pause unknown", ["schedule", "pause", "nope"], {}, None, 2, "nope"),
    ("peaks empty tz", ["peaks", "suggest", "--tz", ""], {}, None, 2, "unknown time zone"),
    ("peaks past retention", ["peaks", "suggest", "--weeks", "20"], {}, None, 2, "history keeps 90"),
    (
        "rank past retention",
        ["templates", "rank", "--days", "30"],
        {"PREHEAT_HISTORY_RETENTION_DAYS": "14"},
        None,
        2,
        "--days 30 reads 30 days",
    ),
    (
        "retention negative",
        ["config", "check"],
        {"PREHEAT_HISTORY_RETENTION_DAYS": "-1"},
        None,
        2,
        "PREHEAT_HISTORY_RETENTION_DAYS",
    ),
    # Files
    ("make-model onto a file", ["dev", "make-model", "/etc/hostname"], {}, None, 2, "is a file"),
    ("make-model arch", ["dev", "make-model", "/tmp/x-model", "--arch", "gpt9"], {}, None, 2, "unknown architecture"),
    ("traffic csv missing", ["traffic", "import", "/no/such.csv"], {}, None, 2, "/no/such.csv"),
    ("watch-pods no scope", ["watch-pods", "--endpoint", "x"], {}, None, 2, "--all-namespaces"),
    # Catalog entries that can only fail: refused by config check and by warm before anything is recorded
    ("prompt missing", ["config", "check"], {}, "<missing>", 2, "does not exist"),
    ("prompt a directory", ["config", "check"], {}, "<directory>", 2, "is not a file"),
    ("prompt empty", ["config", "check"], {}, b"", 2, "is empty"),
    ("prompt blank", ["config", "check"], {}, b"  \n\t\n", 2, "is blank"),
    ("prompt not utf-8", ["config", "check"], {}, b"caf\xe9 au lait", 2, "is not UTF-8"),
    ("prompt too large", ["config", "check"], {}, b"x" * (4 * 1024**2 + 1), 2, "larger than 4 MiB"),
    ("warm, prompt empty", ["warm", "-t", "filed"], {}, b"", 2, "is empty"),
    ("warm, prompt not utf-8", ["warm", "-t", "filed"], {}, b"\xff\xfe", 2, "is not UTF-8"),
    ("warm endpoint, prompt blank", ["warm", "--endpoint", "ep"], {}, b" \n", 2, "is blank"),
    ("model path a file", ["config", "check"], {}, "<model-file>", 2, "is a file, not a model directory"),
]


def _row_counts(database_url: str) -> dict[str, int]:
    from sqlalchemy import create_engine

    engine = create_engine(database_url)
    try:
        metadata = MetaData()
        metadata.reflect(engine)
        with engine.connect() as connection:
            return {name: connection.scalar(select(func.count()).select_from(t)) for name, t in metadata.tables.items()}
    finally:
        engine.dispose()


def _catalog_for(tmp_path, tiny_model, prompt) -> dict[str, str]:
    """A catalog with a template `filed` whose system prompt is a file holding `prompt`."""
    if prompt is None:
        return {}
    folder = tmp_path / "bad-catalog"
    folder.mkdir()
    extra = (
        '\n[templates.filed]\nmodel = "tiny"\nsystem_prompt_file = "filed.txt"\n'
        '\n[endpoints.ep]\nbase_url = "http://127.0.0.1:9/v1"\ntemplates = ["filed"]\n'
    )
    if prompt == "<directory>":
        (folder / "filed.txt").mkdir()
    elif prompt == "<model-file>":
        (folder / "not-a-model").write_text("weights?")
        extra = '\n[models.flat]\npath = "not-a-model"\n'
    elif prompt != "<missing>":
        (folder / "filed.txt").write_bytes(prompt)
    return {"PREHEAT_CATALOG": str(write_catalog(folder, tiny_model, extra))}


@pytest.mark.parametrize(("name", "args", "env", "prompt", "code", "expected"), ROWS, ids=[row[0] for row in ROWS])
def test_bad_input_is_one_line_a_non_zero_exit_and_nothing_written(
    embedded_stack, tmp_path, tiny_model, name, args, env, prompt, code, expected
):
    stack = embedded_stack
    database = f"sqlite:///{stack.home / 'preheat.db'}"
    before = _row_counts(database)
    environment = {**stack.env, **_catalog_for(tmp_path, tiny_model, prompt), **env}
    done = subprocess.run(
        [PREHEAT_CLI, *args], env=environment, cwd=stack.home, capture_output=True, text=True, timeout=120
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert _row_counts(database) == before


def test_the_table_is_at_least_forty_inputs():
    assert len(ROWS) >= 40 and len({row[0] for row in ROWS}) == len(ROWS)
