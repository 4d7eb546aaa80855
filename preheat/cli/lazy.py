"""What the commands need from the database layer, the catalog and the settings, imported
when a command runs: the CLI modules stay light, so `preheat --help` loads neither
SQLAlchemy (about 170 ms of every invocation) nor pydantic's models (about 90 ms)."""

from __future__ import annotations


def session_scope():
    from preheat.history.db import session_scope

    return session_scope()


def utcnow():
    from preheat.history.db import utcnow

    return utcnow()


def aware(moment):
    from preheat.history.db import aware

    return aware(moment)


def load_catalog(path):
    from preheat.core.catalog import load_catalog

    return load_catalog(path)


def get_settings():
    from preheat.core.settings import get_settings

    return get_settings()
