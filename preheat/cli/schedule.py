"""`preheat schedule add | list | pause | resume | remove | slots`: the peak schedules in the
database. A running beat reads them every tick, so a change applies within seconds."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from preheat.cli import render
from preheat.cli.lazy import aware, load_catalog, session_scope, utcnow
from preheat.core.states import RunAction

if TYPE_CHECKING:
    from preheat.history.models import Schedule, ScheduleSlot
from preheat.cli.lazy import get_settings

app = typer.Typer(no_args_is_help=True, help="Peak schedules: when beat warms what, ahead of traffic.")
console = render.console()


@app.command("add")
def add(
    name: str = typer.Argument(..., help="A name: letters, digits, '.', '_' or '-'."),
    cron: str = typer.Option(..., "--cron", help='When the peak begins, e.g. "0 9 * * mon-fri" (5 fields).'),
    timezone: str = typer.Option(None, "--tz", "--timezone", help="IANA zone of the cron (default PREHEAT_TIMEZONE)."),
    lead: int = typer.Option(0, "--lead", help="Seconds ahead of the cron time to fire the warmup (0 to 86400)."),
    template: list[str] = typer.Option(None, "--template", "-t", help="Template to warm (repeat; default: all)."),
    adapter: list[str] = typer.Option(
        None, "--adapter", "-a", help="LoRA adapter to warm: its templates, under it (repeat)."
    ),
    worker: list[str] = typer.Option(
        None, "--worker", "-w", help="Only these workers (repeat; default: every live one)."
    ),
    endpoint: list[str] = typer.Option(None, "--endpoint", "-e", help="Warm these endpoints instead of workers."),
    action: RunAction = typer.Option(
        "warm", "--action", help="warm, sleep (off-peak: KV freed, weights off the device) or wake (a warmup)."
    ),
    model: list[str] = typer.Option(None, "--model", "-m", help="Sleep or wake this model (repeat; default: all)."),
    level: int = typer.Option(None, "--level", min=1, max=2, help="A sleep's level: 1 (default) or 2."),
    paused: bool = typer.Option(False, "--paused", help="Add it paused (resume to start it)."),
) -> None:
    """Add a schedule; beat fires it from its next fire time on. A sleep and a warm (or a
    wake) of one model in the same minute are refused."""
    from preheat.cli.warm import adapter_templates
    from preheat.core.errors import ConfigError
    from preheat.schedules import store

    settings = get_settings()
    catalog = load_catalog(settings.catalog)
    if adapter:
        if action != RunAction.warm:
            raise ConfigError("--adapter is for warm schedules; a sleep or a wake acts on whole models")
        template = adapter_templates(adapter, template)
    targets = store.targets_of(
        catalog, templates=template, workers=worker, endpoints=endpoint, models=model, action=action
    )
    with session_scope() as session:
        schedule = store.add(
            session,
            name=name,
            cron=cron,
            timezone=settings.timezone if timezone is None else timezone,
            targets=targets,
            lead_time_s=lead,
            enabled=not paused,
            action=action,
            sleep_level=level,
            catalog=catalog,
        )
        console.print(f"schedule [bold]{schedule.name}[/] added: {_describe(schedule)}")


@app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Every schedule, with its next fire time and its latest slot."""
    from preheat.schedules import store

    with session_scope() as session:
        schedules = store.list_all(session)
        latest = {row.schedule_name: row for row in reversed(store.recent_slots(session, limit=1000))}
        rows = [(schedule, latest.get(schedule.name)) for schedule in schedules]
    if as_json:
        print(json.dumps([schedule_json(schedule, slot) for schedule, slot in rows], indent=2))
        return
    if not rows:
        console.print("no schedules (add one with `preheat schedule add`)")
        return
    table = Table(title="schedules", title_justify="left")
    for header in (
        "name",
        "kind",
        "action",
        "cron",
        "time zone",
        "lead s",
        "targets",
        "state",
        "next fire (UTC)",
        "latest slot (UTC)",
    ):
        table.add_column(header, no_wrap=header != "targets")
    for schedule, slot in rows:
        next_fire = next_fire_at(schedule)
        table.add_row(
            schedule.name,
            str(schedule.kind),
            _action(schedule),
            schedule.cron,
            schedule.timezone,
            str(schedule.lead_time_s),
            _targets(schedule.targets),
            "enabled" if schedule.enabled else "paused",
            render.when(next_fire) if schedule.enabled and next_fire else "-",
            f"{render.when(slot.slot_at)} {slot.status}" if slot else "-",
        )
    console.print(table)


@app.command("pause")
def pause(name: str) -> None:
    """Stop firing it (its slots while paused are neither fired nor missed)."""
    _set_enabled(name, False)


@app.command("resume")
def resume(name: str) -> None:
    """Fire it again, from its next fire time on."""
    _set_enabled(name, True)


@app.command("remove")
def remove(name: str) -> None:
    """Delete it (the runs it fired stay in history)."""
    from preheat.schedules import store

    with session_scope() as session:
        store.remove(session, name)
    console.print(f"schedule [bold]{name}[/] removed")


@app.command("slots")
def slots(
    name: str = typer.Argument(None, help="One schedule (default: all)."),
    limit: int = typer.Option(20, "--limit", min=1, max=1000),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """What became of recent slots: sent (with the run), missed, unsent or failed, and why."""
    from preheat.schedules import store

    with session_scope() as session:
        if name is not None:
            store.get(session, name)  # an unknown name is an error, not an empty list
        rows = store.recent_slots(session, name, limit)
    if as_json:
        print(json.dumps([slot_json(row) for row in rows], indent=2))
        return
    table = Table(title="slots", title_justify="left")
    for header in ("schedule", "slot", "fired at", "status", "run", "attempts", "reason"):
        table.add_column(header, no_wrap=header != "reason")
    for row in rows:
        table.add_row(
            row.schedule_name,
            render.when(row.slot_at),
            render.when(row.fire_at),
            str(row.status),
            row.run_id.hex[:8] if row.run_id else "-",
            str(row.attempts),
            row.error or "",
        )
    console.print(table)


def _set_enabled(name: str, value: bool) -> None:
    from preheat.schedules import store

    with session_scope() as session:
        schedule = store.set_enabled(session, name, value, load_catalog(get_settings().catalog))
        console.print(f"schedule [bold]{schedule.name}[/] {'resumed' if value else 'paused'}")


def next_fire_at(schedule: Schedule):
    from preheat.schedules import store

    return store.next_fire_at(schedule, utcnow())


def _action(schedule: Schedule) -> str:
    if schedule.action == RunAction.sleep and schedule.sleep_level is not None:
        return f"sleep (level {schedule.sleep_level})"
    return str(schedule.action)


def _targets(targets: dict) -> str:
    if targets.get("models"):
        parts = [f"models: {', '.join(targets['models'])}"]
    else:
        parts = [f"templates: {', '.join(targets.get('templates') or ['all'])}"]
    for key in ("workers", "endpoints"):
        if targets.get(key):
            parts.append(f"{key}: {', '.join(targets[key])}")
    return "; ".join(parts)


def _describe(schedule: Schedule) -> str:
    next_fire = next_fire_at(schedule)
    return (
        f"{_action(schedule)} {schedule.cron} ({schedule.timezone}), lead {schedule.lead_time_s} s, "
        + (f"{_targets(schedule.targets)}; ")
        + (f"next fire {render.when(next_fire)} UTC" if schedule.enabled else "paused")
    )


def schedule_json(schedule: Schedule, latest: ScheduleSlot | None = None) -> dict:
    next_fire = next_fire_at(schedule) if schedule.enabled else None
    return {
        "name": schedule.name,
        "kind": str(schedule.kind),
        "action": str(schedule.action),
        "sleep_level": schedule.sleep_level,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "lead_time_s": schedule.lead_time_s,
        "targets": schedule.targets,
        "enabled": schedule.enabled,
        "detail": schedule.detail,
        "next_fire_at": next_fire.isoformat() if next_fire else None,
        "latest_slot": slot_json(latest) if latest else None,
    }


def slot_json(row: ScheduleSlot) -> dict:
    return {
        "schedule": row.schedule_name,
        "slot_at": aware(row.slot_at).isoformat(),
        "fire_at": aware(row.fire_at).isoformat(),
        "status": str(row.status),
        "run_id": str(row.run_id) if row.run_id else None,
        "attempts": row.attempts,
        "error": row.error,
    }
