"""The beat scheduler: the catalog's ``[schedules.*]`` peaks, fired as ``preheat.warm_fleet``,
and a keep-alive per ``[endpoints.*]``, fired as ``preheat.keep_alive_endpoint``.

Each entry fires one fleet warmup whose run records the trigger (``schedule``) and the
schedule's name. Cron fields are read in the app's time zone (``PREHEAT_TIMEZONE``).
"""

from __future__ import annotations

import datetime as dt
import logging

from celery.beat import PersistentScheduler

from preheat.catalog import Catalog, load_catalog, parse_cron
from preheat.settings import get_settings

log = logging.getLogger(__name__)

ENTRY_PREFIX = "schedule:"
KEEPALIVE_PREFIX = "keepalive:"


def catalog_entries(catalog: Catalog, app=None) -> dict:
    entries = {}
    for name, spec in catalog.schedules.items():
        entries[f"{ENTRY_PREFIX}{name}"] = {
            "task": "preheat.warm_fleet",
            "schedule": parse_cron(spec.cron, app=app),
            "kwargs": {"templates": spec.templates, "trigger": "schedule", "detail": {"schedule": name},
                       "requested_by": "beat"},
        }
    for name, endpoint in catalog.endpoints.items():
        if endpoint.keepalive_interval_s and endpoint.templates:
            # Below the provider's prompt-cache TTL (checked by the catalog); the task itself
            # sends nothing outside the endpoint's active hours.
            entries[f"{KEEPALIVE_PREFIX}{name}"] = {
                "task": "preheat.keep_alive_endpoint",
                "schedule": dt.timedelta(seconds=endpoint.keepalive_interval_s),
                "kwargs": {"endpoint": name},
                "options": {"expires": endpoint.keepalive_interval_s},  # a late ping is no ping
            }
    return entries


class CatalogScheduler(PersistentScheduler):
    """Celery's persistent scheduler, with the catalog's schedules added at start."""

    def setup_schedule(self):
        entries = catalog_entries(load_catalog(get_settings().catalog), app=self.app)
        self.app.conf.beat_schedule = {**self.app.conf.beat_schedule, **entries}
        log.info("beat: %d catalog schedule(s): %s", len(entries), ", ".join(sorted(entries)) or "none")
        super().setup_schedule()
