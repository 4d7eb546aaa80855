"""The OpenAI protocol's answers: a whole answer, a stream's chunks, usage, log probabilities.

What a request's completions look like to a client, in the shapes of `/v1/chat/completions`
and `/v1/completions` (`preheat serve` streams them, `preheat.infer` returns the whole one).
"""

from __future__ import annotations

import re
import time

from preheat.api.requests import Ask
from preheat.api.sampling import TokenLogprob


def usage_of(completions: list) -> dict:
    """One prompt, n answers: the prompt and its reuse counted once, the answers summed."""
    first, generated = completions[0], sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": first.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE token spells a
    byte with, to that byte (printable bytes stand for themselves, the others are shifted
    past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {b: chr(b) for b in printable}, 0
    for byte in range(256):
        if byte not in chars:
            chars[byte], shifted = chr(256 + shifted), shifted + 1
    return {char: byte for byte, char in chars.items()}


_BYTE_OF_CHAR = _byte_of_char()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class LogprobShapes:
    """Log probabilities in the two shapes of the API, token texts decoded one by one, and
    each token's own bytes (half a UTF-8 character is its bytes, not U+FFFD's)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for in the text."""
        piece = self._tokenizer.convert_ids_to_tokens(token_id) or ""
        if self._byte_level and piece and all(char in _BYTE_OF_CHAR for char in piece):
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        if fallback := _BYTE_FALLBACK.fullmatch(piece):  # sentencepiece's byte fallback
            return bytes([int(fallback.group(1), 16)])
        if "▁" in piece:  # sentencepiece's word boundary: a space in the text
            return piece.replace("▁", " ").encode("utf-8")
        return self._text(token_id).encode("utf-8")

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self._text(token_id), "logprob": logprob, "bytes": list(self.token_bytes(token_id))}

    def chat(self, logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict:
        return {
            "content": [
                {
                    **self._chat_entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._chat_entry(t, v) for t, v in lp.top],
                }
                for lp in logprobs
            ]
        }

    def completion(self, logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob], offset: int = 0) -> dict:
        tokens = [self._text(lp.token_id) for lp in logprobs]
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def of(self, ask: Ask, logprobs) -> dict | None:
        if ask.sampling.logprobs is None:
            return None
        return self.chat(logprobs) if ask.chat else self.completion(logprobs)


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None, **choice) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **choice}],
    }


def text_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None, **choice) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, **choice}],
    }


def stream_event(ask: Ask, request_id: str, shapes: LogprobShapes, kind: str, index: int, value) -> dict | None:
    """The chunk of a streamed answer for one event of choice `index`: its start (chat
    sends the role first), a piece, or its end (the finish reason)."""
    chunk = chat_chunk if ask.chat else text_chunk
    if kind == "start":
        return (
            chat_chunk(request_id, ask.model, {"role": "assistant", "content": ""}, index=index) if ask.chat else None
        )
    if kind == "end":
        return chunk(request_id, ask.model, {} if ask.chat else "", value.finish_reason, index=index)
    logprobs = shapes.of(ask, value.logprobs)
    return chunk(
        request_id, ask.model, {"content": value.text} if ask.chat else value.text, index=index, logprobs=logprobs
    )


def usage_chunk(ask: Ask, request_id: str, completions: list) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if ask.chat else "text_completion",
        "created": int(time.time()),
        "model": ask.model,
        "choices": [],
        "usage": usage_of(completions),
    }


def whole_answer(ask: Ask, request_id: str, completions: list, shapes: LogprobShapes) -> dict:
    """The answer not streamed: every choice, the usage, and preheat's own timings."""
    choices = []
    for index, completion in enumerate(completions):
        said = {"message": {"role": "assistant", "content": completion.text}} if ask.chat else {"text": completion.text}
        logprobs = shapes.of(ask, completion.logprobs)
        choices.append({"index": index, **said, "logprobs": logprobs, "finish_reason": completion.finish_reason})
    first = completions[0]
    return {
        "id": request_id,
        "object": "chat.completion" if ask.chat else "text_completion",
        "created": int(time.time()),
        "model": ask.model,
        "choices": choices,
        "usage": usage_of(completions),
        "preheat": {"ttft_ms": first.ttft_ms, "total_ms": first.total_ms},
    }
