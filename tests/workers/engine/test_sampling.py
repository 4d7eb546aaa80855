"""Sampling parameters over a model's defaults, with no model: which processors run, what
each value may be, the presence/frequency penalty, seeds per choice."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from preheat.api.sampling import SamplingError, SamplingParams
from preheat.workers.engine.sampling import ModelDefaults, OutputTokenPenalty, sampler_for

GREEDY_MODEL = ModelDefaults()
SAMPLING_MODEL = ModelDefaults(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)


def kinds(sampler) -> list[type]:
    return [type(p) for p in sampler.processors]


def test_a_request_that_says_nothing_decodes_as_the_models_generation_config_says():
    greedy = sampler_for(SamplingParams(), GREEDY_MODEL, 4, "cpu")
    assert not greedy.do_sample and greedy.processors == [] and greedy.generator is None
    sampled = sampler_for(SamplingParams(), SAMPLING_MODEL, 4, "cpu")
    assert sampled.do_sample and kinds(sampled) == [TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper]
    assert sampled.processors[0].temperature == 0.6 and sampled.processors[1].top_k == 20


def test_what_a_request_sets_wins_and_temperature_zero_is_greedy():
    asked = sampler_for(SamplingParams(temperature=0.7, top_p=0.9), GREEDY_MODEL, 4, "cpu")
    assert asked.do_sample and kinds(asked) == [TemperatureLogitsWarper, TopPLogitsWarper]  # no top_k invented
    assert not sampler_for(SamplingParams(temperature=0.0), SAMPLING_MODEL, 4, "cpu").do_sample
    nucleus_only = sampler_for(SamplingParams(top_p=0.5), GREEDY_MODEL, 4, "cpu")
    assert nucleus_only.do_sample and kinds(nucleus_only) == [TopPLogitsWarper]  # at temperature 1
    penalised = sampler_for(SamplingParams(temperature=0, repetition_penalty=1.3), GREEDY_MODEL, 4, "cpu")
    assert kinds(penalised) == [RepetitionPenaltyLogitsProcessor]  # penalties apply to greedy too


def test_presence_and_frequency_penalties_count_only_generated_tokens():
    penalty = OutputTokenPenalty(presence=0.5, frequency=0.25, prompt_length=2)
    scores = torch.zeros(1, 5)
    ids = torch.tensor([[3, 3, 1, 1, 4]])  # the prompt (3, 3) does not count
    assert penalty(ids, scores).tolist() == [[0.0, -1.0, 0.0, 0.0, -0.75]]
    assert scores.abs().sum() == 0  # the input is not written


def test_a_seed_repeats_and_each_choice_has_its_own():
    logits = torch.randn(50)
    params = SamplingParams(temperature=1.0, seed=11)
    draws = [[sampler_for(params, GREEDY_MODEL, 0, "cpu").choose(logits, [])[0] for _ in range(1)] for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    assert [params.for_choice(i).seed for i in range(3)] == [11, 12, 13]
    assert SamplingParams().for_choice(2).seed is None
    before = logits.clone()
    sampler_for(SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5), GREEDY_MODEL, 0, "cpu").choose(
        logits, [1, 2]
    )
    assert torch.equal(logits, before)  # a cached prefix's logits are shared: never written


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"seed": "7"}, "seed"),
        ({"n": 17}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("a", "b", "c", "d", "e")}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": ((1, 200.0),)}, "logit_bias"),
    ],
)
def test_a_value_that_cannot_be_honoured_is_refused_naming_its_parameter(fields, named):
    with pytest.raises(SamplingError) as refused:
        SamplingParams(**fields)
    assert refused.value.parameter == named and str(refused.value).startswith(f"{named}: ")


def test_an_integer_bias_forces_or_forbids_as_openais_own_examples_write_it():
    logits = torch.zeros(10)
    forced = sampler_for(SamplingParams(temperature=0, logit_bias=((3, 100), (0, -100))), GREEDY_MODEL, 0, "cpu")
    assert forced.choose(logits, [1, 2])[0] == 3
    forbidden = sampler_for(SamplingParams(temperature=0, logit_bias=((0, -100),)), GREEDY_MODEL, 0, "cpu")
    assert forbidden.choose(logits, [1, 2])[0] != 0
