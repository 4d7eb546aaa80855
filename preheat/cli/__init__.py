"""The `preheat` command: admin CLI for warmups, history, the database and dev tools.

Each group lives in its own module; heavy imports (torch, Celery) happen inside the
commands that need them, so `preheat --help` stays instant.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from preheat.errors import PreheatError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="preheat: LLM serving that is never cold when a user arrives.")
err = Console(stderr=True)


def _register() -> None:
    from preheat.cli import config, db, dev, history, warm

    app.add_typer(db.app, name="db")
    app.add_typer(dev.app, name="dev")
    app.add_typer(config.app, name="config")
    app.command("warm")(warm.warm)
    app.command("history")(history.history)


_register()


def main() -> None:
    try:
        app()
    except PreheatError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
