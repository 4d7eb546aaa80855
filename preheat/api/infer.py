"""`preheat.infer`'s two forms, parsed as `/v1/chat/completions` parses a body: the chat form
(messages, for a model or after a template's system prompt) and the template form (a template
and one user input). The task parses its message with it on the worker, the router
(preheat.fleet.routing) before it sends one: one schema, the same refusals by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, model_validator

from preheat.api.requests import ApiError, Ask, parse_chat, refuse, sampling_of
from preheat.api.sampling import DECODING_FIELDS, SamplingError, SamplingParams
from preheat.core.catalog import NAME_PATTERN
from preheat.core.errors import ArgumentError
from preheat.core.text import not_text_at

Name = Annotated[str, Field(pattern=NAME_PATTERN)]


class _Form(BaseModel):
    # strict: "1" is not 1 and 0 is not False.
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _strings_are_text(cls, values):
        # A lone surrogate ("\ud800" in the message's JSON) is valid JSON but no text.
        if isinstance(values, dict) and (where := not_text_at(values)) is not None:
            raise ValueError(f"{where or 'an argument'} is not valid text (a lone surrogate)")
        return values


class TemplateInferArguments(_Form):
    """The template form: a template and one user input, decoded as the decoding fields say
    (the OpenAI parameters of the same names, preheat.api.sampling: one answer, so no `n`)."""

    template: Name
    user_input: str = Field(max_length=200_000)
    _sampling: SamplingParams = PrivateAttr()

    def model_post_init(self, _context) -> None:
        extra = dict(self.model_extra or {})
        if "max_new_tokens" in extra:
            raise ArgumentError("max_new_tokens: renamed max_tokens, as in the chat form")
        for name in extra:
            if name not in TEMPLATE_FORM_DECODING:
                raise ArgumentError(f"{name}: not an argument of the template form")
        try:
            self._sampling = sampling_of(extra)
        except SamplingError as exc:
            raise ArgumentError(str(exc)) from None

    @property
    def sampling(self) -> SamplingParams:
        return self._sampling


TEMPLATE_FORM_DECODING = DECODING_FIELDS - {"n"}
# The template form's own fields: the chat form says the same with messages.
TEMPLATE_FORM_ONLY = {"user_input": "messages", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class ChatInferArguments:
    """The chat form, parsed as `/v1/chat/completions` parses its body (preheat.api.requests:
    one schema, the same refusals by name), with preheat's two additions: `template`, whose
    system prompt leads the messages and whose model is the request's (applied where the
    template is known: `with_template`), and no `stream` (a task returns the whole answer)."""

    ask: Ask  # its model '' when only the template names it
    template: str | None

    @classmethod
    def model_validate(cls, values: dict) -> ChatInferArguments:
        if (where := not_text_at(values)) is not None:
            raise ArgumentError(f"{where or 'an argument'} is not valid text (a lone surrogate)")
        body, template = dict(values), values.get("template")
        body.pop("template", None)
        try:
            if body.pop("stream", False) not in (False, None):
                raise refuse("stream", "a task returns the whole answer; stream over HTTP (`preheat serve`)")
            for name, instead in TEMPLATE_FORM_ONLY.items():
                if name in body:
                    raise refuse(name, f"the template form's field; the chat form takes {instead}")
            if template is not None:
                TEMPLATE_NAME.validate_python(template)
            return cls(parse_chat(body, model_optional=template is not None), template)
        except ApiError as exc:
            raise ArgumentError(exc.message) from None
        except ValidationError:
            raise ArgumentError(f"template: {template!r} is not a catalog name") from None


TEMPLATE_NAME = TypeAdapter(Name)


class InferArguments:
    """`preheat.infer` takes two forms: chat `messages` (with a `model` or a `template`), or
    `template` + `user_input`. Each is parsed by its own schema."""

    @staticmethod
    def model_validate(values: dict) -> ChatInferArguments | TemplateInferArguments:
        if "messages" in values:
            return ChatInferArguments.model_validate(values)
        return TemplateInferArguments.model_validate(values)
