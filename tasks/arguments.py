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


class TemplateInferArguments(_Arguments):
    """The template form: a template and one user input; the decoding fields mean what the
    OpenAI parameters of the same names mean (workers.sampling checks their values, naming
    the one that is wrong)."""

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
    def _decodable(self) -> TemplateInferArguments:
        self.sampling()  # a value out of range is refused here, before the task runs
        return self

    def sampling(self):
        """The decoding asked, through the one mapping every path shares (workers.protocol)."""
        from workers.protocol import sampling_of

        fields = self.model_dump(exclude={"template", "user_input", "max_new_tokens"})
        return sampling_of({**fields, "max_tokens": self.max_new_tokens})


# The template form's own fields: the chat form says the same with messages and max_tokens.
TEMPLATE_FORM_ONLY = {"user_input": "messages", "max_new_tokens": "max_tokens"}


def chat_ask(values: dict, catalog, system_prompt=None):
    """The chat form as `/v1/chat/completions` reads it (workers.protocol.parse_chat: one
    schema, the same refusals by name), with preheat's two additions: `template`, whose
    system prompt leads the messages and whose model is the request's, and no `stream` (a
    task returns the whole answer). `system_prompt(template)` gives the template's prompt as
    the worker resolved it (default: the catalog's). Returns (Ask, template or None); raises
    ApiError, or UnknownNameError for a template the catalog does not have."""
    from dataclasses import replace

    from workers.protocol import invalid, parse_chat, refuse

    body, template = dict(values), values.get("template")
    body.pop("template", None)
    if body.pop("stream", False) not in (False, None):
        raise refuse("stream", "a task returns the whole answer; stream over HTTP (`preheat serve`)")
    for name, instead in TEMPLATE_FORM_ONLY.items():
        if name in body:
            raise refuse(name, f"the template form's field; the chat form takes {instead}")
    if template is None:
        return parse_chat(body), None
    spec = catalog.template(template)  # an unknown template: UnknownNameError, a 404
    if body.get("model", spec.model) != spec.model:
        raise invalid("model", f"template {template!r} is for model {spec.model!r}, not {body['model']!r}")
    ask = parse_chat({**body, "model": spec.model})
    for i, message in enumerate(ask.messages):
        if message["role"] in ("system", "developer"):
            raise invalid(f"messages[{i}].role", f"template {template!r} gives the system prompt; send none beside it")
    system = {"role": "system", "content": (system_prompt or catalog.system_prompt)(template)}
    return replace(ask, messages=(system, *ask.messages)), template


class ChatInferArguments(_Arguments):
    """The chat form, checked as the HTTP route checks its body (see chat_ask)."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _as_the_route_reads_it(cls, values):
        from pydantic_core import PydanticCustomError

        from preheat.catalog import current_catalog
        from preheat.errors import PreheatError
        from preheat.settings import get_settings
        from workers.protocol import ApiError

        try:
            chat_ask(values, current_catalog(get_settings().catalog), system_prompt=lambda _: "")
        except (ApiError, PreheatError) as exc:
            raise PydanticCustomError("request", "{message}", {"message": getattr(exc, "message", str(exc))}) from None
        return values


class InferArguments:
    """`preheat.infer` takes two forms: chat `messages` (with a `model` or a `template`), or
    the older `template` + `user_input`. Each is checked by its own schema."""

    @staticmethod
    def model_validate(values: dict):
        chat = "messages" in values
        return (ChatInferArguments if chat else TemplateInferArguments).model_validate(values)


class WarmFleetArguments(_Arguments):
    templates: list[Name] | None = Field(None, max_length=256)
    trigger: str = Field("schedule", pattern=r"^(schedule|pod_event|worker_online|manual|peak|demand)$")
    detail: dict | None = None
    requested_by: str = Field("beat", min_length=1, max_length=200)
    workers: list[Nodename] | None = Field(None, max_length=1024)
    only_if_cold: bool = False
