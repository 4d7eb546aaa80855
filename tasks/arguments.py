"""What each task accepts, as a schema: a message from the broker is untrusted input (any
client that can reach Redis can send one), so its arguments are checked before the task
body runs or writes anything. The base task (preheat.celery.PreheatTask) applies them."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from preheat.catalog import NAME_PATTERN
from preheat.text import not_text_at

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


class InferArguments(_Arguments):
    """A template request; the decoding fields mean what the OpenAI parameters of the same
    names mean (workers.sampling checks their values, naming the one that is wrong)."""

    template: Name
    user_input: str = Field(max_length=200_000)
    max_new_tokens: int = Field(64, ge=1, le=4096)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=4)

    @model_validator(mode="after")
    def _decodable(self) -> InferArguments:
        self.sampling()  # a value out of range is refused here, before the task runs
        return self

    def sampling(self):
        """The decoding asked, through the one mapping every path shares (workers.protocol)."""
        from workers.protocol import sampling_of

        fields = self.model_dump(exclude={"template", "user_input", "max_new_tokens"})
        return sampling_of({**fields, "max_tokens": self.max_new_tokens})


class WarmFleetArguments(_Arguments):
    templates: list[Name] | None = Field(None, max_length=256)
    trigger: str = Field("schedule", pattern=r"^(schedule|pod_event|worker_online|manual|peak|demand)$")
    detail: dict | None = None
    requested_by: str = Field("beat", min_length=1, max_length=200)
    workers: list[Nodename] | None = Field(None, max_length=1024)
    only_if_cold: bool = False
