"""The `preheat` command as a user runs it: one clear line and a non-zero exit on bad input."""

import json
import subprocess
import sys

import pytest

from preheat.core import processes
from tests.conftest import PREHEAT_CLI


def run(*args, env, cwd=None):
    return subprocess.run([PREHEAT_CLI, *args], env=env, capture_output=True, text=True, timeout=120, cwd=cwd)


def one_error_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def embedded(embedded_stack):
    return embedded_stack


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("PREHEAT_BROKER_URL", "redis:/nohost", "error: invalid setting PREHEAT_BROKER_URL: has no host"),
        ("PREHEAT_DEVICE", "tpu", "error: invalid setting PREHEAT_DEVICE"),
        ("PREHEAT_CATALOG", "/nonexistent.toml", "error: catalog /nonexistent.toml does not exist"),
    ],
)
def test_bad_settings_exit_2_with_one_line(embedded, variable, value, expected):
    done = run("config", "check", env={**embedded.env, variable: value})
    assert done.returncode == 2
    assert one_error_line(done).startswith(expected)


def test_a_missing_model_folder_exits_2(embedded, tmp_path):
    catalog = tmp_path / "broken.toml"
    catalog.write_text('[models.m]\npath = "/no/such/model"\n[templates.t]\nmodel = "m"\nsystem_prompt = "x"\n')
    done = run("config", "check", env={**embedded.env, "PREHEAT_CATALOG": str(catalog)})
    assert done.returncode == 2
    assert one_error_line(done) == "error: model 'm': directory /no/such/model does not exist"


def test_config_check_passes_on_a_good_catalog(embedded):
    done = run("config", "check", env=embedded.env)
    assert done.returncode == 0 and "1 model(s), 1 template(s)" in done.stdout


def test_warm_refuses_unknown_templates_and_absent_workers_writing_nothing(embedded):
    unknown = run("warm", "--template", "nope", env=embedded.env)
    assert unknown.returncode == 2
    assert one_error_line(unknown) == "error: unknown template 'nope' (catalog has: support)"

    nobody = run("warm", env=embedded.env)
    assert nobody.returncode == 3
    assert "no live preheat worker (none sent a heartbeat lately)" in one_error_line(nobody)

    ghost = run("warm", "--worker", "ghost@nowhere", env=embedded.env)
    assert ghost.returncode == 2
    assert one_error_line(ghost) == "error: worker(s) not live: ghost@nowhere (live: none)"

    unknown_endpoint = run("warm", "--endpoint", "nope", env=embedded.env)
    assert unknown_endpoint.returncode == 2
    assert one_error_line(unknown_endpoint) == "error: unknown endpoint 'nope' (catalog has: nothing)"
    both = run("warm", "--endpoint", "e", "--worker", "w@h", env=embedded.env)
    assert both.returncode == 2 and "give --worker or --endpoint, not both" in one_error_line(both)

    history = run("history", "--json", env=embedded.env)
    assert history.returncode == 0 and history.stdout.strip() == "[]"  # nothing half-written


def test_history_input_errors(embedded):
    assert run("history", env=embedded.env).stdout.strip() == "no warmup runs recorded yet"
    bad_since = run("history", "--since", "yesterday", env=embedded.env)
    assert bad_since.returncode == 2 and "--since 'yesterday'" in one_error_line(bad_since)
    missing = run("history", "deadbeef", env=embedded.env)
    assert missing.returncode == 2 and one_error_line(missing) == "error: no run matches 'deadbeef'"
    bad_status = run("history", "--status", "sleepy", env=embedded.env)
    assert bad_status.returncode == 2 and "sleepy" in bad_status.stderr


def test_make_model_refuses_a_non_empty_folder(embedded, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    done = run("dev", "make-model", str(tmp_path / "full"), env=embedded.env)
    assert done.returncode == 2 and "exists and is not empty" in one_error_line(done)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_db_upgrade_and_check(embedded):
    assert run("db", "upgrade", env=embedded.env).returncode == 0
    done = run("db", "check", env=embedded.env)
    assert done.returncode == 0 and "models and migrations agree" in done.stdout


def test_unreachable_services_exit_5_with_one_line(embedded, tmp_path):
    port = processes.free_port()  # nothing listens there
    broker_down = run("warm", env={**embedded.env, "PREHEAT_BROKER_URL": f"redis://:pw@127.0.0.1:{port}/0"})
    assert broker_down.returncode == 5
    line = one_error_line(broker_down)
    assert line.startswith("error: cannot reach the broker:") and "Connection refused" in line
    assert "pw" not in line

    db_down = run(
        "history", env={**embedded.env, "PREHEAT_DATABASE_URL": f"postgresql+psycopg://u:secret@127.0.0.1:{port}/x"}
    )
    assert db_down.returncode == 5
    assert one_error_line(db_down).startswith("error: cannot use the history database: connection failed")
    assert "secret" not in db_down.stderr


def test_an_unmigrated_database_says_what_to_run(embedded, tmp_path):
    done = run("history", env={**embedded.env, "PREHEAT_HOME": str(tmp_path / "fresh")})
    assert done.returncode == 5
    assert one_error_line(done) == "error: the history database has no preheat tables yet: run `preheat db upgrade`"


def test_serve_refuses_a_busy_port_and_half_a_tls_setting_with_one_line(embedded):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = run("serve", "--host", "127.0.0.1", "--port", str(port), env=embedded.env)
    assert taken.returncode == 2
    assert one_error_line(taken) == (
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use); set PREHEAT_SERVE_PORT"
    )
    half = run("serve", env={**embedded.env, "PREHEAT_SERVE_TLS_CERT": "/etc/cert.pem"})
    assert half.returncode == 2 and "PREHEAT_SERVE_TLS_KEY go together" in one_error_line(half)
    bad_port = run("serve", env={**embedded.env, "PREHEAT_SERVE_PORT": "99999"})
    assert bad_port.returncode == 2 and "invalid setting PREHEAT_SERVE_PORT" in one_error_line(bad_port)


# Arguments that are not UTF-8: Python hands them over with lone surrogates in place of the
# bytes (surrogateescape); every command refuses them before doing anything.
NOT_UTF8 = "\udcff\udcfe"
NOT_TEXT_ARGUMENTS = [
    ("warm", "--template", f"sup{NOT_UTF8}port"),
    ("warm", "--worker", f"gpu0@node{NOT_UTF8}"),
    ("infer", "support", f"Where is my parcel {NOT_UTF8}?"),
    ("schedule", "add", f"peak{NOT_UTF8}", "--cron", "0 9 * * 1-5", "--template", "support"),
    ("schedule", "add", "peak", "--cron", "0 9 * * 1-5", "--template", "support", "--timezone", f"Europe/{NOT_UTF8}"),
    ("history", f"{NOT_UTF8}"),
    ("traffic", "import", f"/tmp/{NOT_UTF8}.csv"),
    ("peaks", "suggest", "--timezone", f"Europe/{NOT_UTF8}"),
    ("serve", "--host", f"{NOT_UTF8}"),
]


def test_arguments_that_are_not_utf8_are_one_line_and_nothing_is_written(embedded):
    for argv in NOT_TEXT_ARGUMENTS:
        done = embedded.cli_here(*argv)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        position = next(i for i, arg in enumerate(argv, start=1) if NOT_UTF8 in arg)
        assert done.stderr.strip().startswith(f"error: argument {position} is not UTF-8 text (byte 0xff at offset"), (
            argv,
            done.stderr,
        )
    # The same through a real process, bytes and all.
    raw = subprocess.run(
        [PREHEAT_CLI.encode(), b"warm", b"--template", b"caf\xc3\xa9\xff"],
        env=embedded.env,
        capture_output=True,
        timeout=120,
    )
    assert raw.returncode == 2
    assert raw.stderr.decode().strip() == "error: argument 3 is not UTF-8 text (byte 0xff at offset 5)"
    for listing in (("history", "--json"), ("schedule", "list", "--json")):
        assert json.loads(embedded.cli_here(*listing).stdout) == []  # nothing half-written


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--endpoint", "x"], "error: give --namespace (repeatable) or --all-namespaces, not both and not neither"),
        (
            ["-n", "serving", "--all-namespaces", "--endpoint", "x"],
            "error: give --namespace (repeatable) or --all-namespaces, not both and not neither",
        ),
        (["-n", " ", "--endpoint", "x"], "error: --namespace must not be empty"),
    ],
)
def test_watch_pods_needs_one_scope_of_namespaces(embedded, args, expected):
    done = run("watch-pods", *args, env=embedded.env)
    assert done.returncode == 2
    assert one_error_line(done) == expected


def test_config_check_says_which_chat_template_each_model_gets(embedded, tmp_path, tiny_model, dev_model):
    catalog = tmp_path / "chat.toml"
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    catalog.write_text(
        f'[models.own]\npath = "{tiny_model}"\n\n[models.none]\npath = "{dev_model("gpt2")}"\n\n'
        f'[models.set]\npath = "{tiny_model}"\nchat_template_file = "mine.jinja"\n'
    )
    done = run("config", "check", env={**embedded.env, "PREHEAT_CATALOG": str(catalog)})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("model ")]
    assert lines == [
        f"model own: chat template from the model's own ({tiny_model / 'chat_template.jinja'})",
        "model none: chat template from preheat's default (ChatML): the model has none",
        f"model set: chat template from the catalog ({tmp_path / 'mine.jinja'})",
    ]
    (tmp_path / "mine.jinja").unlink()
    missing = run("config", "check", env={**embedded.env, "PREHEAT_CATALOG": str(catalog)})
    assert missing.returncode == 2 and "model 'set': chat_template_file" in one_error_line(missing)
    catalog.write_text(f'[models.both]\npath = "{tiny_model}"\nchat_template = "x"\nchat_template_file = "y"\n')
    both = run("config", "check", env={**embedded.env, "PREHEAT_CATALOG": str(catalog)})
    assert both.returncode == 2 and "at most one of chat_template or chat_template_file" in one_error_line(both)


def test_the_cli_loads_no_database_layer_model_or_catalog_until_a_command_needs_it():
    """`preheat --help` and a command's --help cost the interpreter and typer, nothing more:
    SQLAlchemy, torch, Celery and the catalog's pydantic models are imported by the
    commands that use them."""
    probe = (
        "import sys; from preheat.cli import main; sys.argv = ['preheat', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('sqlalchemy', 'torch', 'celery', 'transformers', 'preheat.core.catalog',"
        " 'preheat.core.settings') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in done.stdout, done.stdout + done.stderr


def test_infer_without_an_answer_says_so_in_one_line_and_exits_cleanly(services_stack):
    """No worker takes the request: one line and exit 4 when the wait ends, and nothing
    after it (the result's unsubscribe used to run at interpreter shutdown and print a
    traceback: `sys.meta_path is None`). A result backend that refuses: one line, exit 5."""
    waited = services_stack.cli("infer", "support", "Where is my parcel?", "--timeout", "1")
    assert waited.returncode == 4, waited
    assert "no warm worker answered within 1 s" in waited.stdout and waited.stderr.strip() == "", waited

    refused_env = {**services_stack.env, "PREHEAT_BROKER_URL": f"redis://127.0.0.1:{processes.free_port()}/0"}
    refused = run("infer", "support", "Where is my parcel?", "--timeout", "1", env=refused_env, cwd=services_stack.home)
    assert refused.returncode == 5 and "cannot reach the result backend" in one_error_line(refused), refused
