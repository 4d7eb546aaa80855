"""What a request asks of decoding, declared once: the fields of the OpenAI API (and the extras
vLLM serves: top_k, min_p, repetition_penalty) as `SamplingParams`, each checked here.

Every path that takes decoding fields reads them by these names: the bodies of `/v1/*`
(`preheat serve`), both forms of `preheat.infer`, the options of `preheat infer`. How a token
is then chosen (transformers' processors over the model's defaults) is the engine's
(preheat.workers.engine.sampling); nothing here needs torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from preheat.core.text import shown

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20


class SamplingError(ValueError):
    """A sampling parameter with a value that cannot be honoured; names the parameter."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.parameter = name


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of decoding. None: the model's default (generation_config.json)."""

    max_tokens: int = 64
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: int | None = None  # None: off; k: the chosen token's and the k most likely ones'
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, 1 << 20)
        _check_number("temperature", self.temperature, 0.0, 2.0)
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1, 1 << 20)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("seed", self.seed, -(1 << 63), (1 << 64) - 1)
        _check_int("n", self.n, 1, 16)
        _check_int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingError("stop", "must be a string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise SamplingError("stop", f"at most {MAX_STOP_SEQUENCES} sequences (got {len(self.stop)})")
        for token_id, bias in self.logit_bias:
            _check_int("logit_bias", token_id, 0, 1 << 31)
            _check_number("logit_bias", bias, -100.0, 100.0)

    def for_choice(self, index: int) -> SamplingParams:
        """Choice `index` of n: its own seed (seed + index), so choices differ yet repeat."""
        if self.seed is None or index == 0:
            return self
        from dataclasses import replace

        return replace(self, seed=(self.seed + index) % (1 << 64))


def _check_number(name: str, value, low: float, high: float, *, low_open: bool = False) -> None:
    if value is None:
        return
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise SamplingError(name, f"must be a number (got {shown(value)})")
    if value < low or value > high or (low_open and value == low):
        raise SamplingError(name, f"must be in {'(' if low_open else '['}{low:g}, {high:g}] (got {shown(value)})")


def _check_int(name: str, value, low: int, high: int) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SamplingError(name, f"must be an integer from {low} to {high} (got {shown(value)})")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens, most likely first


# The decoding fields by their API names: SamplingParams' own.
DECODING_FIELDS = frozenset(field.name for field in fields(SamplingParams))
