"""The Celery app's configuration: the reliability and security settings the design relies on."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from preheat.celery.app import celery_config, create_app
from preheat.celery.flower import refuse_open_flower
from preheat.celery.queues import route_task, worker_queue
from preheat.celery.task import PreheatTask
from preheat.core.errors import ConfigError, UnknownNameError
from preheat.core.settings import load_settings
from tests.conftest import write_catalog


@pytest.fixture
def settings(tmp_path, tiny_model, apply_env):
    catalog = write_catalog(
        tmp_path, tiny_model, '\n[schedules.morning]\ncron = "50 8 * * 1-5"\ntemplates = ["support"]\n'
    )
    apply_env(
        {"PREHEAT_HOME": str(tmp_path / "home"), "PREHEAT_CATALOG": str(catalog), "PREHEAT_TIMEZONE": "Europe/Berlin"}
    )
    return load_settings()


def test_json_only_late_acks_one_at_a_time(settings):
    config = celery_config(settings)
    assert config["accept_content"] == ["json"] and config["result_accept_content"] == ["json"]
    assert config["task_serializer"] == "json"
    assert config["task_acks_late"] and config["task_reject_on_worker_lost"]
    assert config["worker_prefetch_multiplier"] == 1
    assert config["broker_connection_retry_on_startup"] is True
    assert config["timezone"] == "Europe/Berlin"


def test_redis_visibility_timeout_outlasts_the_longest_warmup(settings, apply_env, tmp_path):
    apply_env({"PREHEAT_BROKER_URL": "redis://127.0.0.1:6379/11", "PREHEAT_HOME": str(tmp_path)})
    redis_settings = load_settings()
    options = celery_config(redis_settings)["broker_transport_options"]
    assert options == {"visibility_timeout": 7200, "polling_interval": 0.25}
    assert options["visibility_timeout"] > celery_config(redis_settings)["task_time_limit"]


def test_embedded_broker_folders_are_created(settings):
    options = celery_config(settings)["broker_transport_options"]
    for key in ("data_folder_in", "data_folder_out", "control_folder", "processed_folder"):
        assert Path(options[key]).is_dir()
        assert Path(options[key]).parent == (settings.home / "broker").resolve()


def test_every_worker_has_its_own_queue_with_a_transport_safe_name():
    assert worker_queue("gpu0@node-a.cluster.local") == "preheat.w.gpu0_node-a.cluster.local"
    for name in ("preheat.warm_worker", "preheat.sleep_worker", "preheat.wake_worker"):  # each replica's own
        assert route_task(name, (), {"worker": "gpu0@a"}, {}) == {"queue": "preheat.w.gpu0_a"}
    assert route_task("preheat.warm_fleet", (), {}, {}) is None


def test_requests_go_to_their_models_inference_queue_and_unknown_templates_are_refused(settings):
    assert route_task("preheat.infer", (), {"template": "support", "user_input": "hi"}, {}) == {
        "queue": "preheat.infer.tiny"
    }
    assert route_task("preheat.infer", ("support", "hi"), {}, {}) == {"queue": "preheat.infer.tiny"}
    with pytest.raises(UnknownNameError, match="unknown template 'nope'"):
        route_task("preheat.infer", (), {"template": "nope"}, {})


def test_results_only_for_requests_in_redis_or_files(settings, tmp_path):
    assert celery_config(settings)["task_ignore_result"] is True
    results = (tmp_path / "home" / "results").resolve()
    assert (
        celery_config(settings)["result_backend"] == f"preheat.celery.results:PromptFilesystemBackend+file://{results}"
    )
    redis = load_settings(broker_url="redis://127.0.0.1:6379/11")
    assert (
        celery_config(redis)["result_backend"]
        == "preheat.celery.redisresults:ResyncingRedisBackend+redis://127.0.0.1:6379/11"
    )


def test_a_worker_runs_as_many_threads_as_its_engine_has_rows_and_one_more(settings):
    """Each request holds a pool thread while the engine decodes it (docs/architecture.md):
    one more thread for a warmup, and one message reserved per thread."""
    config = celery_config(load_settings(max_running_requests=24))
    assert config["worker_pool"] == "threads" and config["worker_concurrency"] == 25
    assert config["worker_prefetch_multiplier"] == 1 and config["task_acks_late"] is True
    assert config["worker_consumer"] == "preheat.celery.consumer:PreheatConsumer"


@pytest.mark.parametrize(
    ("pool", "concurrency", "outcome"),
    [
        ("thread", 65, "fine"),  # the default: the rows' cap (64) and a thread for a warmup
        ("thread", 128, "fine"),  # every row and every queued request
        ("thread", 129, "refused"),
        ("solo", 1, "warned"),
        ("thread", 1, "warned"),
    ],
)
def test_the_pool_is_checked_against_the_engine_at_start(settings, pool, concurrency, outcome, caplog):
    from preheat.tasks.worker import check_concurrency

    if outcome == "refused":
        with pytest.raises(SystemExit) as stopped:
            check_concurrency(pool, concurrency, settings)
        assert stopped.value.code == 2
        return
    with caplog.at_level("WARNING"):
        check_concurrency(pool, concurrency, settings)
    assert ("decodes up to PREHEAT_MAX_RUNNING_REQUESTS=64 together" in caplog.text) == (outcome == "warned")


def test_beat_uses_the_database_scheduler_and_keeps_no_state_file(settings):
    config = celery_config(settings)
    assert config["beat_scheduler"] == "preheat.schedules.beat:DatabaseScheduler"
    assert "beat_schedule_filename" not in config  # slots are recorded in the database


def test_tasks_are_named_under_preheat_and_share_the_base_task(settings):
    app = create_app(settings)
    app.loader.import_default_modules()
    names = {name for name in app.tasks if not name.startswith("celery.")}
    assert names == {
        "preheat.warm_worker",
        "preheat.warm_fleet",
        "preheat.warm_endpoint",
        "preheat.keep_alive_endpoint",
        "preheat.infer",
        "preheat.sleep_worker",
        "preheat.wake_worker",
        "preheat.sleep_endpoint",
        "preheat.wake_endpoint",
    }
    for name in names:
        assert PreheatTask in type(app.tasks[name]).__mro__


def test_flower_is_refused_without_auth():
    refuse_open_flower(["celery", "-A", "preheat", "worker"], {})
    refuse_open_flower(["celery", "-A", "preheat", "flower", "--basic-auth=a:correct-horse"], {})
    refuse_open_flower(["celery", "-A", "preheat", "flower", "--basic-auth", "a:correct-horse,b:battery-staple"], {})
    refuse_open_flower(["celery", "-A", "preheat", "flower"], {"FLOWER_BASIC_AUTH": "a:correct-horse"})
    oauth = {"FLOWER_AUTH_PROVIDER": "flower.views.auth.GithubLoginHandler", "FLOWER_OAUTH2_KEY": "k"}
    refuse_open_flower(
        ["celery", "-A", "preheat", "flower", "--auth=.*@example.com"], {**oauth, "FLOWER_OAUTH2_SECRET": "s"}
    )
    with pytest.raises(ConfigError, match="Flower needs auth"):
        refuse_open_flower(["celery", "-A", "preheat", "flower"], {})


FLOWER = ["celery", "-A", "preheat", "flower"]


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {"FLOWER_BASIC_AUTH": "admin:correct-horse,"}, "FLOWER_BASIC_AUTH: entry 2 is empty"),
        (["--basic-auth="], {}, "--basic-auth: entry 1 is empty"),
        (["--basic-auth"], {}, "--basic-auth: entry 1 is empty"),
        (["--basic_auth=,admin:correct-horse"], {}, "--basic-auth: entry 1 is empty"),
        ([], {"FLOWER_BASIC_AUTH": ""}, "FLOWER_BASIC_AUTH: entry 1 is empty"),
        ([], {"FLOWER_BASIC_AUTH": "admin:"}, "the password of 'admin' is shorter than 8"),
        ([], {"FLOWER_BASIC_AUTH": "admin:short"}, "the password of 'admin' is shorter than 8"),
        ([], {"FLOWER_BASIC_AUTH": "admin:        "}, "or blank"),
        ([], {"FLOWER_BASIC_AUTH": ":correct-horse"}, "entry 1 is not user:password"),
        ([], {"FLOWER_BASIC_AUTH": "admin"}, "entry 1 is not user:password"),
        (["--basic-auth=admin:correct-horse"], {"FLOWER_BASIC_AUTH": "x"}, "FLOWER_BASIC_AUTH: entry 1 is not"),
        (["--auth="], {}, "--auth is empty"),
        ([], {"FLOWER_AUTH": ".*"}, "FLOWER_AUTH needs FLOWER_AUTH_PROVIDER"),
        (["--auth=.*@example.com", "--auth_provider=x", "--oauth2_key=k"], {}, "needs FLOWER_OAUTH2_SECRET"),
    ],
)
def test_flower_refuses_a_credential_that_is_no_credential(argv, environ, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        refuse_open_flower([*FLOWER, *argv], environ)
    assert "correct-horse" not in str(refused.value)


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_celery_refuses_to_start_on_a_malformed_broker_url(command, apply_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREHEAT_")}
    env["PREHEAT_BROKER_URL"] = "redis:/no-host"
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "preheat", command], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "preheat: invalid setting PREHEAT_BROKER_URL: has no host (expected e.g. redis://127.0.0.1:6379/0)"
    )


def test_beat_and_the_cli_load_the_task_modules_without_torch(settings):
    """Beat and the watchers import every task module (Celery's `include`) to send them: the
    runtime behind the tasks, with torch and transformers, is imported by a worker alone. A
    beat that took 3-8 s to import them on busy cores missed the slot it restarted for."""
    probe = (
        "import sys\n"
        "from preheat.celery.app import app\n"
        "app.loader.init_worker(); app.finalize()\n"  # what `celery beat` does before it runs
        "assert 'preheat.warm_worker' in app.tasks and 'preheat.infer' in app.tasks\n"
        "print('HEAVY', [m for m in ('torch', 'transformers', 'preheat.workers.runtime') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=os.environ)
    assert "HEAVY []" in done.stdout, done.stdout + done.stderr


def test_preheat_worker_is_celerys_worker_command_without_the_umbrella_cli(settings):
    """`preheat-worker` takes every option of `celery worker` (Celery parses them) and
    loads none of the umbrella's subcommands or plugins."""
    probe = (
        "import sys\n"
        "from preheat.celery.worker_command import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('LOADED', [m for m in ('flower', 'click_repl', 'celery.bin.celery', 'torch') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=os.environ)
    assert "LOADED []" in done.stdout, done.stdout + done.stderr
    assert "Usage: preheat-worker [OPTIONS]" in done.stdout and "--pool" in done.stdout and "--hostname" in done.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "preheat.celery.worker_command", "--pool=threads", "--no-such-option"],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ,
    )
    assert refused.returncode == 2 and "No such option '--no-such-option'" in refused.stderr
