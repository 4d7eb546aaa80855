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
