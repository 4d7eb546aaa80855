"""What each task accepts, as a schema: a message from the broker is untrusted input (any
client that can reach Redis can send one), so its arguments are parsed before the task body
runs or writes anything, and the body is handed what was parsed. The base task
(preheat.celery.task.PreheatTask) applies them."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from preheat.core.catalog import NAME_PATTERN
from preheat.core.text import not_text_at

Name = Annotated[str, Field(pattern=NAME_PATTERN)]
RunId = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{8}-?([0-9a-fA-F]{4}-?){3}[0-9a-fA-F]{12}$")]
Nodename = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[^\s]+$")]


class _Arguments(BaseModel):
    # strict: "1" is not 1 and 0 is not False; extra: an unknown argument is a sender's bug.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _strings_are_text(cls, values):
        # A lone surrogate ("\ud800" in the message's JSON) is valid JSON but no text: it
        # would fail in the tokenizer or a database row, after the job had started.
        if isinstance(values, dict) and (where := not_text_at(values)) is not None:
            raise ValueError(f"{where or 'an argument'} is not valid text (a lone surrogate)")
        return values


class WarmWorkerArguments(_Arguments):
    run_id: RunId
    worker: Nodename
    templates: list[Name] = Field(min_length=1, max_length=256)
    only_if_cold: bool = False


class SleepWorkerArguments(_Arguments):
    run_id: RunId
    worker: Nodename
    models: list[Name] = Field(min_length=1, max_length=64)
    level: int = Field(1, ge=1, le=2)


class WakeWorkerArguments(_Arguments):
    run_id: RunId
    worker: Nodename
    models: list[Name] = Field(min_length=1, max_length=64)
    templates: list[Name] = Field(default_factory=list, max_length=256)


class WarmEndpointArguments(_Arguments):
    run_id: RunId
    endpoint: Name
    templates: list[Name] = Field(min_length=1, max_length=256)
    base_url: str | None = Field(None, pattern=r"^https?://[^/\s]+", max_length=2048)
    target: Nodename | None = None


class SleepEndpointArguments(_Arguments):
    run_id: RunId
    endpoint: Name
    level: int | None = Field(None, ge=1, le=2)


class WakeEndpointArguments(_Arguments):
    run_id: RunId
    endpoint: Name
    templates: list[Name] = Field(min_length=1, max_length=256)


class KeepAliveArguments(_Arguments):
    endpoint: Name


# preheat.infer's forms are the API's (preheat/api/infer.py): the router parses with them too.
class WarmFleetArguments(_Arguments):
    templates: list[Name] | None = Field(None, max_length=256)
    trigger: str = Field("schedule", pattern=r"^(schedule|pod_event|worker_online|manual|peak|demand)$")
    detail: dict | None = None
    requested_by: str = Field("beat", min_length=1, max_length=200)
    workers: list[Nodename] | None = Field(None, max_length=1024)
    only_if_cold: bool = False
