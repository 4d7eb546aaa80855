"""preheat: LLM serving that is never cold when a user arrives.

The Celery app lives in :mod:`preheat.celery` (``celery -A preheat …`` finds it there);
importing this package stays cheap so the CLI starts fast.
"""

__version__ = "0.1.0"
