from pathlib import Path

import pytest

from preheat.core.catalog import load_catalog
from preheat.core.errors import ConfigError, UnknownNameError

GOOD = """
[models.tiny]
path = "models/tiny"

[templates.support]
model = "tiny"
system_prompt = "You are helpful."

[templates.code]
model = "tiny"
system_prompt_file = "prompts/code.txt"

[endpoints.vllm]
base_url = "http://10.0.0.1:8000/v1"
templates = ["support"]

[schedules.morning]
cron = "50 8 * * 1-5"
templates = ["support", "code"]
"""


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "preheat.toml"
    path.write_text(body)
    return path


def test_paths_resolve_against_the_catalog_folder(tmp_path, monkeypatch):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "code.txt").write_text("You write Python.")
    monkeypatch.chdir("/")
    catalog = load_catalog(write(tmp_path, GOOD))
    assert catalog.model_path("tiny") == str(tmp_path / "models" / "tiny")
    assert catalog.system_prompt("code") == "You write Python."
    assert list(catalog.templates) == ["support", "code"]


def test_hub_ids_are_passed_through(tmp_path):
    catalog = load_catalog(write(tmp_path, '[models.llama]\nhub_id = "meta-llama/Llama-3.1-8B-Instruct"\n'))
    assert catalog.model_path("llama") == "meta-llama/Llama-3.1-8B-Instruct"
    catalog.check_model_paths()  # nothing local to check


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('[templates.a]\nmodel = "nope"\nsystem_prompt = "x"\n', "templates.a.model: unknown model 'nope'"),
        ('[models.m]\npath = "/m"\n[templates.a]\nmodel = "m"\n', "give exactly one of system_prompt"),
        ('[models.m]\npath = "/m"\n[templates.a]\nmodel = "m"\nsystem_prompt = "  "\n', "system_prompt is empty"),
        ('[models.m]\npath = "/m"\ncolour = "red"\n', "models.m.colour: Extra inputs are not permitted"),
        ('[models.m]\npath = "/m"\ndtype = "int3"\n', "models.m.dtype"),
        (
            '[models.m]\npath = "/m"\nhub_id = "org/m"\n',
            "models.m: give exactly one of path (a local folder) or hub_id",
        ),
        ('[models.m]\nhub_id = "../etc"\n', "models.m.hub_id"),
        ('[schedules.s]\ncron = "61 8 * * *"\ntemplates = ["a"]\n', "cron '61 8 * * *' is invalid"),
        ('[schedules.s]\ncron = "8 * * *"\ntemplates = ["a"]\n', "must have 5 fields"),
        ('[endpoints.e]\nbase_url = "ftp://x"\n', "endpoints.e.base_url"),
        ('[endpoints.e]\nbase_url = "http://x"\nmin_connections = 5\nmax_connections = 2\n', "min_connections exceeds"),
        ('[endpoints.e]\nbase_url = "http://x"\nkeepalive_interval_s = 400\n', "must be below prompt_cache_ttl_s"),
        ('[endpoints.e]\nbase_url = "http://x"\nactive_hours = "7-20"\n', "endpoints.e.active_hours"),
        ('[endpoints.e]\nbase_url = "http://x"\ntimezone = "Mars/Base"\n', "unknown time zone 'Mars/Base'"),
        ('[endpoints.e]\nbase_url = "http://x"\nkind = "tgi"\n', "endpoints.e.kind"),
        ('[endpoints.e]\nbase_url = "http://x"\ntemplates = ["nope"]\n', "endpoints.e.templates: unknown template"),
        ('[models."bad name"]\npath = "/m"\n', "names are letters, digits"),
        ("[models\n", "not valid TOML"),
    ],
)
def test_invalid_catalogs_fail_with_the_location(tmp_path, body, expected):
    with pytest.raises(ConfigError) as raised:
        load_catalog(write(tmp_path, body))
    assert expected in str(raised.value)
    assert str(raised.value).startswith(f"catalog {tmp_path / 'preheat.toml'}")


def test_missing_catalog_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="does not exist \\(set PREHEAT_CATALOG\\)"):
        load_catalog(tmp_path / "absent.toml")


def test_missing_or_incomplete_model_folder(tmp_path):
    catalog = load_catalog(write(tmp_path, GOOD))
    with pytest.raises(ConfigError, match=f"model 'tiny': directory {tmp_path / 'models' / 'tiny'} does not exist"):
        catalog.check_model_paths()
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        catalog.check_model_paths()


def test_unknown_names_list_what_exists(tmp_path):
    catalog = load_catalog(write(tmp_path, GOOD))
    with pytest.raises(UnknownNameError, match="unknown template 'chat' \\(catalog has: code, support\\)"):
        catalog.template("chat")
    with pytest.raises(UnknownNameError, match="unknown model 'big'"):
        catalog.model("big")


def test_the_current_catalog_is_parsed_again_only_when_the_file_changes(tmp_path, tiny_model):
    import os

    from preheat.core.catalog import current_catalog
    from tests.conftest import write_catalog

    path = write_catalog(tmp_path, tiny_model)
    first = current_catalog(path)
    assert current_catalog(path) is first  # unchanged file: the same parsed object
    path.write_text(path.read_text() + '\n[templates.more]\nmodel = "tiny"\nsystem_prompt = "Be brief."\n')
    os.utime(path, ns=(first_ns := path.stat().st_mtime_ns + 10**9, first_ns))
    assert set(current_catalog(path).templates) == {"support", "more"}
    with pytest.raises(ConfigError, match="does not exist"):
        current_catalog(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("hours", "utc_hour", "active"),
    [
        ("07:00-20:00", 6, False),
        ("07:00-20:00", 7, True),
        ("07:00-20:00", 19, True),
        ("07:00-20:00", 20, False),
        # An overnight range, in the endpoint's own zone (Berlin is UTC+1 in winter).
        ("22:00-06:00", 20, False),
        ("22:00-06:00", 21, True),
        ("22:00-06:00", 4, True),
        ("22:00-06:00", 5, False),
    ],
)
def test_active_hours_are_read_in_the_endpoints_time_zone(hours, utc_hour, active):
    import datetime as dt

    from preheat.core.catalog import EndpointSpec

    spec = EndpointSpec(
        base_url="http://x/v1", active_hours=hours, timezone="Europe/Berlin" if hours.startswith("22") else "UTC"
    )
    assert spec.is_active(dt.datetime(2026, 11, 30, utc_hour, 30, tzinfo=dt.UTC)) is active
