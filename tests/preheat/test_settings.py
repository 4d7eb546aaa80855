import pytest

from preheat.core.errors import ConfigError
from preheat.core.settings import load_settings


@pytest.fixture(autouse=True)
def _clean_env(apply_env):
    apply_env({})


def test_defaults_are_the_embedded_stack(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = load_settings()
    assert settings.is_embedded
    assert settings.broker == "filesystem://"
    assert settings.database == f"sqlite:///{tmp_path / '.preheat' / 'preheat.db'}"
    assert settings.device == "auto"


def test_services_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("PREHEAT_BROKER_URL", "redis://:s3cret@127.0.0.1:6379/3")
    monkeypatch.setenv("PREHEAT_DATABASE_URL", "postgresql+psycopg://u:pw@db:5432/preheat")
    settings = load_settings()
    assert not settings.is_embedded
    assert settings.broker == "redis://:s3cret@127.0.0.1:6379/3"
    # Secrets are not shown by repr or str: they would end up in logs.
    assert "s3cret" not in repr(settings) and "pw@" not in repr(settings)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("PREHEAT_BROKER_URL", "redis:/127.0.0.1", "invalid setting PREHEAT_BROKER_URL: has no host"),
        ("PREHEAT_BROKER_URL", "kafka://broker:9092", "invalid setting PREHEAT_BROKER_URL: scheme 'kafka'"),
        ("PREHEAT_BROKER_URL", "redis://127.0.0.1:port/0", "invalid setting PREHEAT_BROKER_URL: has an invalid port"),
        ("PREHEAT_BROKER_URL", "redis://127.0.0.1:6379/zero", "invalid setting PREHEAT_BROKER_URL: database index"),
        ("PREHEAT_DATABASE_URL", "mysql://db/x", "invalid setting PREHEAT_DATABASE_URL: driver 'mysql'"),
        ("PREHEAT_DATABASE_URL", "not a url", "invalid setting PREHEAT_DATABASE_URL: is not a database URL"),
        ("PREHEAT_DEVICE", "tpu", "invalid setting PREHEAT_DEVICE: Input should be 'auto', 'cpu' or 'cuda'"),
        ("PREHEAT_TIMEZONE", "Mars/Olympus", "invalid setting PREHEAT_TIMEZONE: unknown time zone 'Mars/Olympus'"),
        (
            "PREHEAT_PROBE_REPEATS",
            "0",
            "invalid setting PREHEAT_PROBE_REPEATS: Input should be greater than or equal to 1",
        ),
        (
            "PREHEAT_ENGINE",
            "sequential",
            "invalid setting PREHEAT_ENGINE: was removed: every request goes through the batching scheduler; "
            "PREHEAT_MAX_RUNNING_REQUESTS=1 decodes one request at a time (got 'sequential')",
        ),
        (
            "PREHEAT_VISIBILITY_TIMEOUT_S",
            "60",
            "invalid setting PREHEAT_VISIBILITY_TIMEOUT_S (60) must exceed PREHEAT_WARMUP_TIME_LIMIT_S (1800)",
        ),
    ],
)
def test_invalid_values_fail_with_one_line_naming_the_setting(monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as raised:
        load_settings()
    message = str(raised.value)
    assert message.startswith(f"invalid setting {variable}") and expected in message
    assert "\n" not in message


def test_url_errors_never_echo_the_url(monkeypatch):
    monkeypatch.setenv("PREHEAT_BROKER_URL", "kafka://user:hunter2@broker:9092")
    with pytest.raises(ConfigError) as raised:
        load_settings()
    assert "hunter2" not in str(raised.value)


def test_a_prefix_store_that_is_a_file_stops_the_processes_that_open_it_not_the_others(monkeypatch, tmp_path):
    named = tmp_path / "prefixes"
    named.write_text("not a folder")
    monkeypatch.setenv("PREHEAT_PREFIX_STORE", str(named))
    settings = load_settings()  # a CLI that never opens the store is not refused for it
    with pytest.raises(ConfigError) as raised:
        settings.prefix_store_folder  # noqa: B018 - what a worker and `preheat serve` read at start
    assert str(raised.value).startswith(f"invalid setting PREHEAT_PREFIX_STORE: {named} is a file, not a folder")
    monkeypatch.setenv("PREHEAT_PREFIX_STORE", str(tmp_path / "new-folder"))
    assert load_settings().prefix_store_folder == (tmp_path / "new-folder").resolve()  # made when first written
