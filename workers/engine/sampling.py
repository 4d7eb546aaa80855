"""How the next token is chosen: a request's sampling parameters over the model's defaults.

The parameters (`preheat.api.sampling.SamplingParams`) are checked where a request is
parsed; here they become a sampler. What a request leaves out comes from the model's own ``generation_config.json``, as
transformers' ``generate`` takes it: a model whose file says ``do_sample: true`` samples
with its temperature / top_p / top_k by default, any other decodes greedily. A parameter
the model does not set either is neutral (no top_k is invented).

Scores go through transformers' own processors and warpers (``LogitsProcessorList``); the
one rule transformers lacks, OpenAI's presence and frequency penalties, is a processor of
the same shape. Sampling draws from each request's own ``torch.Generator``: a seed gives
the same answer on every run, whatever else the worker serves, and nothing here writes to
the logits it is given (a cached prefix's logits are shared by every request from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are made: the parameters alone need none
    import torch

from preheat.api.sampling import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class ModelDefaults:
    """The sampling a model's generation_config.json asks for when a request does not say."""

    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def of(cls, model) -> ModelDefaults:
        config = getattr(model, "generation_config", None)
        if config is None:
            return cls()
        return cls(
            bool(getattr(config, "do_sample", False)),
            getattr(config, "temperature", None),
            getattr(config, "top_p", None),
            getattr(config, "top_k", None),
            getattr(config, "min_p", None),
            getattr(config, "repetition_penalty", None),
        )


class OutputTokenPenalty:
    """OpenAI's presence and frequency penalties, over the tokens generated so far (not the
    prompt): logit -= frequency * count + presence * (count > 0)."""

    def __init__(self, presence: float, frequency: float, prompt_length: int) -> None:
        self.presence, self.frequency, self.prompt_length = presence, frequency, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        generated = input_ids[0, self.prompt_length :]
        if generated.numel() == 0:
            return scores
        counts = torch.bincount(generated.to(scores.device), minlength=scores.shape[-1])[: scores.shape[-1]]
        penalty = self.frequency * counts + self.presence * (counts > 0)
        return scores - penalty.to(scores.dtype)


@dataclass
class Sampler:
    """One choice's decoding: processors, greedy or sampled, its own generator."""

    processors: list
    do_sample: bool
    generator: torch.Generator | None
    logprobs: int | None

    @property
    def plain_greedy(self) -> bool:
        """The most likely token, nothing applied before and nothing reported: an argmax."""
        return not (self.do_sample or self.processors or self.logprobs is not None)

    def choose(self, logits: torch.Tensor, ids: list[int]) -> tuple[int, TokenLogprob | None]:
        """The next token from a [vocab] row of raw logits, given every id so far."""
        import torch

        # A copy in float32 whatever the logits' dtype: a processor may write in place, and the
        # caller's logits (the step's own, a view) stay as they are.
        scores = logits.to(torch.float32, copy=True).unsqueeze(0)
        if self.processors:
            input_ids = torch.tensor([ids], dtype=torch.long, device=scores.device)
            for processor in self.processors:
                scores = processor(input_ids, scores)
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self.generator)[0, 0])
        else:
            token = int(scores.argmax())
        return token, (self._logprob(logits, token) if self.logprobs is not None else None)

    def _logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        # The model's own distribution (as vLLM reports by default), not the processed one.
        import torch

        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = ()
        if self.logprobs:
            values, indices = torch.topk(logprobs, self.logprobs)
            top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
        return TokenLogprob(token, float(logprobs[token]), top)


def sampler_for(params: SamplingParams, defaults: ModelDefaults, prompt_length: int, device) -> Sampler:
    """The processors and the draw for `params` over the model's defaults (see module doc)."""
    import torch
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    model_sampling = defaults.do_sample
    asked = any(v is not None for v in (params.top_p, params.top_k, params.min_p))
    temperature = params.temperature
    if temperature is None:
        temperature = (defaults.temperature if model_sampling else None) or 1.0
        do_sample = model_sampling or asked
    else:
        do_sample = temperature > 0
    processors: list = []
    if params.logit_bias:
        # OpenAI's own examples give integers ({"50256": -100}); transformers takes floats only.
        processors.append(SequenceBiasLogitsProcessor([[[token], float(bias)] for token, bias in params.logit_bias]))
    repetition = params.repetition_penalty or defaults.repetition_penalty
    if repetition is not None and repetition != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OutputTokenPenalty(params.presence_penalty, params.frequency_penalty, prompt_length))
    if do_sample:
        top_k = _chosen(params.top_k, defaults.top_k, model_sampling)
        top_p = _chosen(params.top_p, defaults.top_p, model_sampling)
        min_p = _chosen(params.min_p, defaults.min_p, model_sampling)
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if top_k is not None and top_k > 0:
            processors.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
        if min_p:
            processors.append(MinPLogitsWarper(min_p))
    generator = None
    if do_sample:
        generator = torch.Generator(device=device)
        if params.seed is not None:
            generator.manual_seed(params.seed % (1 << 64))
        else:
            generator.seed()
    return Sampler(processors, do_sample, generator, params.logprobs)


def _chosen(asked, default, model_sampling: bool):
    return asked if asked is not None else (default if model_sampling else None)
