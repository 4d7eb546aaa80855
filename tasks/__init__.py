"""Celery task definitions: thin bodies that call `workers/` or a service function.

Tasks take ids and names (never objects), re-fetch state, and return quietly when what
they were sent for is gone. The plumbing is in :class:`preheat.celery.app.PreheatTask`.
"""
