"""preheat: LLM serving that is never cold when a user arrives.

Importing this package stays cheap so the CLI starts fast: the Celery app is built on first
use of ``preheat.app`` (``celery -A preheat …`` asks for it), in preheat.celery.app.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "app":
        from preheat.celery.app import app

        return app
    raise AttributeError(f"module 'preheat' has no attribute {name!r}")
