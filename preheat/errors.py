"""Errors that carry a message meant for the person at the terminal."""


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
