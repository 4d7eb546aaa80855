"""Errors that carry a message meant for the person at the terminal."""

import sys
from typing import NoReturn


class PreheatError(Exception):
    """Base for errors preheat reports as one line and a non-zero exit."""

    exit_code = 1


class ConfigError(PreheatError):
    """A setting, the catalog, or a path it names is invalid."""

    exit_code = 2


class UnknownNameError(PreheatError):
    """A model, template, worker or endpoint name that the catalog or fleet does not know."""

    exit_code = 2


class NoWorkersError(PreheatError):
    """No live worker answered, so a warmup would reach nobody."""

    exit_code = 3


class ModelLoadError(PreheatError):
    """A catalog model could not be loaded (missing directory, corrupt weights, …)."""


class DeviceOutOfMemory(PreheatError):
    """The device (GPU, or the CPU's allocator) could not hold what a prefill or a request
    needed. The memory is released and the worker goes on; the message says what was asked."""


def exit_with(exc: PreheatError) -> NoReturn:
    """One line on stderr and the error's exit code, for processes `celery` starts, where a
    traceback would bury the message."""
    print(f"preheat: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(exc.exit_code)


class RequestRefused(PreheatError):
    """A request the API refuses (bad input, an unknown model, a full queue), in the words and
    with the status and code `/v1/chat/completions` answers it with."""

    exit_code = 2

    def __init__(self, message: str, status: int = 400, code: str | None = None) -> None:
        super().__init__(message, status, code)
        self.message, self.status, self.code = message, status, code

    def __str__(self) -> str:
        return f"{self.status} {self.code or 'error'}: {self.message}"


class ArgumentError(ValueError):
    """What a schema that is not a pydantic model raises: the argument and what is wrong."""
