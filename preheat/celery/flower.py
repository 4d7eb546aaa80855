"""Flower never runs open: `celery -A preheat flower` refuses to start without a real credential.

Flower can run any registered task and shut workers down, so the value of its credential is
checked, not its presence: every basic-auth entry user:password with a password of at least
MIN_FLOWER_PASSWORD characters, or OAuth with its provider and client credentials.
"""

from __future__ import annotations

from preheat.core.errors import ConfigError

MIN_FLOWER_PASSWORD = 8


def _option_values(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """Every value given to one of `names`, as --name=value or --name value."""
    values = []
    for index, argument in enumerate(argv):
        name, equals, value = argument.partition("=")
        if name in names:
            values.append(value if equals else (argv[index + 1] if index + 1 < len(argv) else ""))
    return values


def _given(argv: list[str], environ: dict[str, str], names: tuple[str, ...], variable: str) -> list[tuple[str, str]]:
    """(where, value) of an option from the command line and its variable, set or empty."""
    found = [(names[0], value) for value in _option_values(argv, names)]
    return found + ([(variable, environ[variable])] if variable in environ else [])


def check_basic_auth(where: str, value: str) -> None:
    """Every entry user:password with both parts non-empty and a password of at least
    MIN_FLOWER_PASSWORD characters; no empty entry (a trailing comma added one that
    `Authorization: Basic =` matched). The message never shows a password."""
    for number, entry in enumerate(value.split(","), start=1):
        user, colon, password = entry.partition(":")
        if not entry.strip():
            raise ConfigError(f"{where}: entry {number} is empty; every entry is user:password")
        if not colon or not user.strip():
            raise ConfigError(f"{where}: entry {number} is not user:password")
        if len(password) < MIN_FLOWER_PASSWORD or not password.strip():
            raise ConfigError(
                f"{where}: the password of {user!r} is shorter than {MIN_FLOWER_PASSWORD} characters or blank"
            )


def check_oauth(where: str, value: str, argv: list[str], environ: dict[str, str]) -> None:
    """--auth is the e-mail pattern OAuth users must match: it opens nothing without a
    provider and its client credentials."""
    if not value.strip():
        raise ConfigError(f"{where} is empty: it is the e-mail pattern of the users OAuth lets in")
    for names, variable in (
        (("--auth_provider", "--auth-provider"), "FLOWER_AUTH_PROVIDER"),
        (("--oauth2_key", "--oauth2-key"), "FLOWER_OAUTH2_KEY"),
        (("--oauth2_secret", "--oauth2-secret"), "FLOWER_OAUTH2_SECRET"),
    ):
        if not any(v.strip() for _, v in _given(argv, environ, names, variable)):
            raise ConfigError(f"{where} needs {variable} (or {names[0]}): OAuth without it lets nobody in safely")


def refuse_open_flower(argv: list[str], environ: dict[str, str]) -> None:
    """Flower can run any registered task and shut workers down: it never starts here
    without a real credential. The value is checked, not its presence."""
    if "flower" not in argv[1:]:
        return
    basic = _given(argv, environ, ("--basic-auth", "--basic_auth"), "FLOWER_BASIC_AUTH")
    oauth = _given(argv, environ, ("--auth",), "FLOWER_AUTH")
    if not basic and not oauth:
        raise ConfigError("Flower needs auth: set FLOWER_BASIC_AUTH=user:password (or --auth with an OAuth provider)")
    for where, value in basic:
        check_basic_auth(where, value)
    for where, value in oauth:
        check_oauth(where, value, argv, environ)
