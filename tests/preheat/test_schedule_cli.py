"""`preheat schedule`: bad input is one clear line, exit 2, and nothing written."""

import json

import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("add", "x", "--cron", "0 9 * *"), "must have 5 fields"),
        (("add", "x", "--cron", "0 9 * * *", "--tz", "Mars/Olympus"), "unknown time zone 'Mars/Olympus'"),
        (("add", "x", "--cron", "0 9 * * *", "-t", "nope"), "unknown template 'nope'"),
        (("add", "x", "--cron", "0 9 * * *", "--lead", "-1"), "between 0 and 86400"),
        (("add", "bad name!", "--cron", "0 9 * * *"), "letters, digits"),
        (("add", "x", "--cron", "0 9 * * *", "-w", "w1@a", "-e", "vllm"), "not both"),
        (("pause", "nope"), "unknown schedule 'nope'"),
        (("add", "x", "--cron", "0 9 * * *", "-m", "tiny"), "--model is for sleep and wake schedules"),
        (("add", "x", "--cron", "0 9 * * *", "--action", "wake", "--level", "2"), "--level is a sleep's"),
        (("add", "x", "--cron", "0 9 * * *", "--action", "sleep", "-m", "nope"), "unknown model 'nope'"),
        (("add", "x", "--cron", "0 9 * * *", "--action", "nap"), "'nap' is not one of"),
        (("add", "x", "--cron", "0 9 * * *", "--action", "sleep", "-m", "tiny", "-t", "support"), "not both"),
    ],
)
def test_bad_schedule_input_is_refused_with_the_reason(embedded_stack, args, message):
    result = embedded_stack.cli_here("schedule", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert json.loads(embedded_stack.cli_here("schedule", "list", "--json").stdout) == []


def test_add_list_pause_resume_remove(embedded_stack):
    stack = embedded_stack
    added = stack.cli(
        "schedule",
        "add",
        "morning",
        "--cron",
        "0 9 * * mon-fri",
        "--tz",
        "Europe/Berlin",
        "--lead",
        "600",
        "-t",
        "support",
    )
    assert added.returncode == 0 and "next fire" in added.stdout, added.stderr
    assert stack.cli("schedule", "add", "morning", "--cron", "0 9 * * *").returncode == 2  # exists
    [listed] = json.loads(stack.cli("schedule", "list", "--json").stdout)
    assert listed["cron"] == "0 9 * * mon-fri" and listed["timezone"] == "Europe/Berlin"
    assert listed["targets"] == {"templates": ["support"]} and listed["enabled"] is True
    assert listed["next_fire_at"].endswith(("07:50:00+00:00", "06:50:00+00:00"))  # 08:50 Berlin, CET or CEST
    assert stack.cli("schedule", "pause", "morning").returncode == 0
    [paused] = json.loads(stack.cli("schedule", "list", "--json").stdout)
    assert paused["enabled"] is False and paused["next_fire_at"] is None
    assert stack.cli("schedule", "resume", "morning").returncode == 0
    assert stack.cli("schedule", "remove", "morning").returncode == 0
    assert json.loads(stack.cli("schedule", "list", "--json").stdout) == []


def test_a_sleep_and_a_warm_of_one_model_in_the_same_minute_are_refused_at_add_and_at_resume(embedded_stack):
    stack = embedded_stack
    assert stack.cli_here("schedule", "add", "night", "--cron", "0 22 * * *", "--action", "sleep").returncode == 0
    # The warm fires at 22:00 too (its peak at 22:05, lead 300 s): refused, naming both and the minute.
    clash = stack.cli_here("schedule", "add", "late", "--cron", "5 22 * * fri", "--lead", "300", "-t", "support")
    assert clash.returncode == 2
    assert "schedule 'late' would warm tiny in the same minute as schedule 'night' would sleep it" in clash.stderr
    # Paused, it may be added; resumed, the same rule refuses it.
    assert (
        stack.cli_here("schedule", "add", "late", "--cron", "5 22 * * fri", "--lead", "300", "--paused").returncode == 0
    )
    resumed = stack.cli_here("schedule", "resume", "late")
    assert resumed.returncode == 2 and "same minute as schedule 'night'" in resumed.stderr
    # Another minute is no contradiction; nor another worker's schedule.
    assert stack.cli_here("schedule", "add", "early", "--cron", "0 7 * * *", "--action", "wake").returncode == 0
    elsewhere = ("schedule", "add", "other", "--cron", "0 22 * * *", "-w", "w2@b", "-t", "support")
    assert (
        stack.cli_here("schedule", "add", "mine", "--cron", "0 21 * * *", "--action", "sleep", "-w", "w1@a").returncode
        == 0
    )
    listed = {s["name"]: s for s in json.loads(stack.cli_here("schedule", "list", "--json").stdout)}
    assert (listed["night"]["action"], listed["night"]["sleep_level"]) == ("sleep", 1)
    assert listed["early"]["action"] == "wake" and listed["late"]["enabled"] is False
    assert stack.cli_here(*elsewhere).returncode == 2  # every worker includes those of 'night'
