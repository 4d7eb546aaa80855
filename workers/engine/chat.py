"""Chat requests rendered the way the model expects: its own chat template.

Every chat-shaped request (``/v1/chat/completions``, ``preheat.infer``, warmup probes) is
turned into ids by ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``,
the ids transformers, vLLM, SGLang and TGI compute for the same messages. A model with no
template of its own (and none set in the catalog) uses ``preheat.workers.engine.resident.DEFAULT_CHAT_TEMPLATE``
(ChatML), set when it is loaded.

A template's cached prefix is what every conversation with its system prompt shares once
rendered: the longest common prefix of the *ids* of conversations that differ only in the
user's text. It is derived from rendered ids, never by joining strings, so it holds for any
template (one that folds the system prompt into the first user turn included) and any
tokenizer (BPE may merge across the place where the user's text starts: the common prefix
stops before such a merge). A request still checks the ids before reusing them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from preheat.workers.engine.kvcache import CacheKey, shared_length
from preheat.workers.engine.resident import ResidentModel

# User turns that differ from their first character on, in several scripts and shapes: the
# ids all of them share after the system prompt are the ids every user turn shares.
_PROBE_TURNS = ("A", "z", "7", " x", "  ", "\t", "\n", "\n\n", "\n\n\n", "?", "é", "日本")

Messages = Sequence[dict]


class ChatTemplateError(ValueError):
    """The model's chat template cannot render these messages (e.g. no system role)."""


def render(resident: ResidentModel, messages: Messages) -> torch.Tensor:
    """The ids of `messages` ready for the assistant's answer, shape [1, n], on the CPU."""
    from jinja2 import TemplateError

    try:
        ids = resident.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template of model {resident.name!r} refuses these messages: {exc}") from None
    return torch.tensor([list(ids)], dtype=torch.long)


def system_prompt_of(messages: Messages) -> str | None:
    """The system prompt a template's prefix is rendered from (`TemplatePrefix`): a lone
    leading system message. Other heads (two system messages, a developer message, a
    named one) have none: their ids are still the template's on those messages, and a
    conversation's remembered turns still serve them."""
    if len(messages) < 2 or messages[0]["role"] != "system" or "name" in messages[0]:
        return None
    return messages[0]["content"] if messages[1]["role"] in ("user", "assistant") else None


def conversation(system_prompt: str | None, user_input: str) -> list[dict]:
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*head, {"role": "user", "content": user_input}]


def common_prefix(rows: Sequence[np.ndarray]) -> np.ndarray:
    """The longest run of leading ids every row has."""
    return rows[0][: min(shared_length(rows[0], row) for row in rows)]


@dataclass(frozen=True)
class TemplatePrefix:
    """A system prompt as the model's chat template renders it: the ids every conversation
    with it starts with, and their cache key."""

    model: str
    system_prompt: str
    ids: torch.Tensor  # [1, n], CPU
    key: CacheKey

    @classmethod
    def of(cls, resident: ResidentModel, system_prompt: str, space: str | None = None) -> TemplatePrefix:
        """`space`: the cache namespace of its ids, the model's name unless an adapter's."""
        rendered = [render(resident, conversation(system_prompt, turn))[0].numpy() for turn in _PROBE_TURNS]
        shared = common_prefix(rendered)
        if len(shared) == 0:
            raise ChatTemplateError(f"the chat template of model {resident.name!r} shares no ids between requests")
        ids = torch.from_numpy(shared.copy()).unsqueeze(0)
        return cls(resident.name, system_prompt, ids, CacheKey.of(space or resident.name, shared))

    def prompt_ids(self, resident: ResidentModel, user_input: str) -> torch.Tensor:
        """The request's ids: the system prompt and the user's turn, rendered."""
        return render(resident, conversation(self.system_prompt, user_input))
