"""The `preheat` command: admin CLI for warmups, history, the database and dev tools.

Each group lives in its own module; heavy imports (torch, Celery) happen inside the
commands that need them, so `preheat --help` stays instant.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from preheat.core.errors import ConfigError, PreheatError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="preheat: LLM serving that is never cold when a user arrives.",
)
err = Console(stderr=True)


def _register() -> None:
    from preheat.cli import (
        bench,
        config,
        db,
        dev,
        endpoints,
        exporter,
        history,
        infer,
        learn,
        report,
        schedule,
        serve,
        sleep,
        warm,
        watch,
        workers,
    )

    app.add_typer(bench.app, name="bench")
    app.add_typer(db.app, name="db")
    app.add_typer(dev.app, name="dev")
    app.add_typer(config.app, name="config")
    app.add_typer(schedule.app, name="schedule")
    app.add_typer(learn.traffic_app, name="traffic")
    app.add_typer(learn.peaks_app, name="peaks")
    app.add_typer(learn.templates_app, name="templates")
    app.command("warm")(warm.warm)
    app.command("sleep")(sleep.sleep)
    app.command("wake")(sleep.wake)
    app.command("history")(history.history)
    app.command("report")(report.report)
    app.command("infer")(infer.infer)
    app.command("workers")(workers.workers)
    app.command("serve")(serve.serve)
    app.command("endpoints")(endpoints.endpoints)
    app.command("exporter")(exporter.exporter)
    app.command("watch-pods")(watch.watch_pods)
    app.command("watch-workers")(watch.watch_workers)


_register()


EXIT_UNAVAILABLE = 5


def service_error(exc: Exception) -> str | None:
    """One line for a broker or database that cannot be used, or None if `exc` is something else."""
    from kombu.exceptions import OperationalError as BrokerError
    from sqlalchemy.exc import OperationalError as DatabaseError
    from sqlalchemy.exc import ProgrammingError

    if isinstance(exc, BrokerError):
        return f"cannot reach the broker: {exc}"
    redis_error = _redis_cause(exc)
    if redis_error is not None:  # the result backend (Celery gives up on it as a RuntimeError)
        return f"cannot reach the result backend: {str(redis_error).splitlines()[0]}"
    if isinstance(exc, DatabaseError | ProgrammingError):
        # The driver's first line says what went wrong; the rest is SQL and parameters.
        reason = str(exc.orig or exc).strip().splitlines()[0]
        if "no such table" in reason or ('relation "' in reason and "does not exist" in reason):
            return "the history database has no preheat tables yet: run `preheat db upgrade`"
        return f"cannot use the history database: {reason}"
    return None


def _redis_cause(exc: BaseException) -> BaseException | None:
    try:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeout
    except ImportError:  # pragma: no cover - redis is a dependency
        return None
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RedisConnectionError | RedisTimeout):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def check_arguments_are_text(argv: list[str]) -> None:
    """Arguments are text: bytes that are not UTF-8 reach Python as lone surrogates, which
    would fail later, half-way (a task message, a database row). One line here instead."""
    for position, argument in enumerate(argv, start=1):
        try:
            argument.encode("utf-8")
        except UnicodeEncodeError as exc:
            offset = len(argument[: exc.start].encode("utf-8", "surrogateescape"))
            byte = argument.encode("utf-8", "surrogateescape")[offset]
            raise ConfigError(f"argument {position} is not UTF-8 text (byte 0x{byte:02x} at offset {offset})") from None


def _click_exceptions():
    try:
        from typer._click import exceptions  # typer vendors click from 0.2x on
    except ImportError:  # pragma: no cover - older typer, on click itself
        from click import exceptions
    return exceptions


def fail_line(message: str) -> None:
    """The one error line. The message quotes user and catalog text (a `[endpoints.x.sleep]`
    hint, a server's reply): escaped, so Rich prints it as written, never as markup."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def main() -> None:
    # A command that runs the engine in this process (a bench, `serve`) runs it as a worker
    # does: the workers' OpenMP settings, which take effect only if set before torch loads.
    import preheat.workers  # noqa: F401

    clicks = _click_exceptions()
    try:
        check_arguments_are_text(sys.argv[1:])
        # Not standalone: usage errors come here, to be one line like every other bad input.
        code = app(standalone_mode=False)
        if isinstance(code, int) and not isinstance(code, bool) and code:
            sys.exit(code)  # a command's typer.Exit(code)
    except clicks.NoArgsIsHelpError as exc:
        # A group asked with no command: its help, as before.
        print(exc.ctx.get_help() if exc.ctx else exc.format_message())
        sys.exit(2)
    except clicks.UsageError as exc:
        # An option out of range, a choice not offered, a missing argument, an unknown
        # command: one line naming the option and what it takes.
        message = " ".join(exc.format_message().split())
        fail_line(message)
        sys.exit(2)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except PreheatError as exc:
        fail_line(str(exc))
        sys.exit(exc.exit_code)
    except OSError as exc:
        # A path preheat cannot use (an unwritable PREHEAT_HOME, a folder where a file
        # belongs): the path and why, on one line.
        if exc.filename is None:
            raise
        fail_line(f"cannot use {exc.filename}: {exc.strerror}")
        sys.exit(2)
    except Exception as exc:
        message = service_error(exc)
        if message is None:
            raise
        fail_line(message)
        sys.exit(EXIT_UNAVAILABLE)
