"""Decoding from cached prefixes on every architecture of the dev models: token-identical
to transformers' own `generate` on the chat-templated ids, sampling, stop strings, eos ids
from generation_config.json, conversations remembered, sliding windows."""

import pytest
import torch

from tests.conftest import SUPPORT_PROMPT, load_resident, support_request
from workers.chat import conversation, render
from workers.devmodel import ARCHITECTURES, FLAVOURS
from workers.generate import PrefixEngine
from workers.kvcache import CacheBudget, KVCacheManager
from workers.prefix import encode
from workers.sampling import SamplingError, SamplingParams

USER_INPUTS = ["Where is my parcel? It was due on Monday.", "", "x" * 300, "Ünïcødé ✓ 包裹"]
SLIDING = ("mistral", "phi3", "gemma3")


def greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **more)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def resident(request, dev_model):
    return load_resident(dev_model(request.param), name=request.param)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return load_resident(tiny_model, name="llama")


@pytest.fixture
def engine():
    return PrefixEngine(KVCacheManager(CacheBudget(max_entries=8, max_bytes=256 * 1024**2)))


def reference_generate(resident, prompt_ids, max_new_tokens, **options):
    """transformers' own generate, from scratch, with no prefix anywhere."""
    options = {"do_sample": False, **options}
    with torch.inference_mode():
        out = resident.model.generate(
            input_ids=prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=resident.tokenizer.pad_token_id,
            **options,
        )
    return out[0, prompt_ids.shape[-1] :].tolist()


@pytest.mark.parametrize("user_input", USER_INPUTS)
def test_greedy_output_from_the_cached_prefix_is_token_identical_to_transformers(resident, engine, user_input):
    prefix_ids, prompt_ids = support_request(resident, user_input)
    messages = conversation(SUPPORT_PROMPT, user_input)
    expected_ids = resident.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert prompt_ids[0].tolist() == list(expected_ids["input_ids"])
    engine.prefill(resident, prefix_ids, label="support")

    warm = engine.generate(resident, prompt_ids, greedy(24)).collect()
    cold = engine.generate(resident, prompt_ids, greedy(24), use_cache=False).collect()

    assert warm.cached_tokens == prefix_ids.shape[-1] and cold.cached_tokens == 0
    assert warm.token_ids == cold.token_ids == reference_generate(resident, prompt_ids, 24)
    assert warm.text == resident.tokenizer.decode(warm.token_ids, skip_special_tokens=True)


def test_a_prompt_that_is_the_prefix_is_answered_from_its_stored_logits(resident, engine):
    """No forward pass and no cut: a sliding-window layer past its window cannot be cut."""
    prefix_ids, _ = support_request(resident, "")
    entry = engine.prefill(resident, prefix_ids).entry
    for stream in (True, False):
        completion = engine.generate(resident, prefix_ids, greedy(6))
        pieces = [piece.text for piece in completion] if stream else [completion.collect().text]
        assert "".join(pieces) == completion.completion.text
        assert completion.completion.cached_tokens == entry.num_tokens
        assert completion.completion.token_ids == reference_generate(resident, prefix_ids, 6)


def test_the_prefix_tensors_and_logits_are_unchanged_by_the_requests_from_them(resident, engine):
    prefix_ids, prompt_ids = support_request(resident, "Hello")
    entry = engine.prefill(resident, prefix_ids).entry
    layers = entry.payload.cache.layers
    before = [(layer.keys.data_ptr(), layer.keys.clone(), layer.values.clone()) for layer in layers]
    logits = entry.payload.logits.clone()
    engine.generate(resident, prompt_ids, greedy(16)).collect()
    engine.generate(resident, prefix_ids, SamplingParams(max_tokens=4, temperature=1.5, seed=3)).collect()
    engine.generate(resident, prefix_ids, greedy(4, repetition_penalty=1.5, presence_penalty=1.0)).collect()
    for layer, (ptr, keys, values) in zip(layers, before, strict=True):
        assert layer.keys.data_ptr() == ptr
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert torch.equal(entry.payload.logits, logits)
    assert entry.payload.cache.get_seq_length() == prefix_ids.shape[-1]


def test_an_entry_holds_and_is_charged_exactly_what_its_layers_need(resident, engine):
    prefix_ids, _ = support_request(resident, "")
    entry = engine.prefill(resident, prefix_ids).entry
    config = resident.model.config.get_text_config()
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if resident.name in ("mistral", "phi3"):
        kinds = ["sliding_attention"] * config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n = prefix_ids.shape[-1]
    positions = [min(n, window - 1) if kind == "sliding_attention" else n for kind in kinds]
    expected = sum(2 * heads * p * head_dim * 4 for p in positions) + config.vocab_size * 4
    assert entry.nbytes == expected
    assert entry.truncatable == (resident.name not in SLIDING)
    if resident.name in SLIDING:
        assert n > window  # the case that matters: a prefix longer than the window


def test_streaming_yields_the_text_in_pieces_and_holds_the_entry_until_done(llama, engine):
    prefix_ids, prompt_ids = support_request(llama, "Tell me more.")
    entry = engine.prefill(llama, prefix_ids).entry
    stream = engine.generate(llama, prompt_ids, greedy(12))
    pieces = []
    for piece in stream:
        pieces.append(piece.text)
        assert entry.ref_count == 1  # in use: cannot be evicted mid-request
    assert entry.ref_count == 0
    assert "".join(pieces) == stream.completion.text
    assert stream.completion.ttft_ms > 0 and stream.completion.total_ms >= stream.completion.ttft_ms


def test_a_prompt_whose_ids_differ_from_the_prefix_falls_back_to_full_prefill(llama, engine):
    prefix_ids, _ = support_request(llama, "")
    engine.prefill(llama, prefix_ids)
    other = encode(llama, "Hi. " + SUPPORT_PROMPT, with_bos=False)  # no BOS, other text: nothing shared
    completion = engine.generate(llama, other, greedy(8)).collect()
    assert completion.cached_tokens == 0
    assert completion.token_ids == reference_generate(llama, other, 8)
    assert engine.cache.stats().misses == 1


def test_a_stop_string_across_a_token_boundary_ends_the_answer_and_is_never_released(llama, engine):
    _, prompt_ids = support_request(llama, "Where is my parcel?")
    free = engine.generate(llama, prompt_ids, greedy(24)).collect()
    # A stop string that starts inside one token and ends inside the next, where it first occurs.
    pieces = [llama.tokenizer.decode([t]) for t in free.token_ids]
    ends = [sum(len(p) for p in pieces[: i + 1]) for i in range(len(pieces))]
    at, start, stop = next(
        (i, ends[i] - 1, free.text[ends[i] - 1 : ends[i] + 1])
        for i in range(1, len(pieces) - 1)
        if len(pieces[i]) >= 2 and pieces[i + 1] and free.text.find(free.text[ends[i] - 1 : ends[i] + 1]) == ends[i] - 1
    )

    stream = engine.generate(llama, prompt_ids, greedy(24, stop=(stop, "never seen")))
    released = [piece.text for piece in stream]
    done = stream.completion
    assert done.finish_reason == "stop" and done.text == free.text[:start] == "".join(released)
    assert not any(stop in piece for piece in released)
    assert done.token_ids == free.token_ids[: len(done.token_ids)] and len(done.token_ids) <= at + 2


def test_every_eos_id_of_generation_config_ends_the_answer(llama, engine):
    """<|eot_id|> is not the tokenizer's eos: only generation_config.json names it."""
    end_of_turn = llama.tokenizer.convert_tokens_to_ids(FLAVOURS["llama"].end_of_turn)
    assert end_of_turn != llama.tokenizer.eos_token_id
    _, prompt_ids = support_request(llama, "Hi")
    done = engine.generate(llama, prompt_ids, greedy(10, logit_bias=((end_of_turn, 100.0),))).collect()
    assert done.token_ids == [end_of_turn] and done.finish_reason == "stop" and done.text == ""


def test_seeded_sampling_repeats_and_seeds_differ(llama, engine):
    prefix_ids, prompt_ids = support_request(llama, "Where is my parcel?")
    engine.prefill(llama, prefix_ids)
    asked = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=1)
    first = engine.generate(llama, prompt_ids, asked).collect()
    again = engine.generate(llama, prompt_ids, asked).collect()
    cold = engine.generate(llama, prompt_ids, asked, use_cache=False).collect()
    assert first.token_ids == again.token_ids == cold.token_ids
    others = {tuple(engine.generate(llama, prompt_ids, asked.for_choice(i)).collect().token_ids) for i in range(1, 4)}
    assert len(others | {tuple(first.token_ids)}) > 1


def test_the_repetition_penalty_is_transformers_own(llama, engine):
    _, prompt_ids = support_request(llama, "Say it again and again")
    done = engine.generate(llama, prompt_ids, greedy(16, repetition_penalty=1.3)).collect()
    assert done.token_ids == reference_generate(llama, prompt_ids, 16, repetition_penalty=1.3)


def test_logprobs_are_the_models_own_distribution(llama, engine):
    _, prompt_ids = support_request(llama, "Hi")
    done = engine.generate(llama, prompt_ids, greedy(5, logprobs=3)).collect()
    assert [lp.token_id for lp in done.logprobs] == done.token_ids
    for lp in done.logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_remembered_turn_serves_the_next_turn_beyond_the_system_prompt(arch, dev_model, engine):
    resident = load_resident(dev_model(arch), name=arch)
    prefix_ids, _ = support_request(resident, "")
    engine.prefill(resident, prefix_ids, pin=True)
    turn_one = conversation(SUPPORT_PROMPT, "Where is my parcel?")
    first = engine.generate(resident, render(resident, turn_one), greedy(8), remember=True).collect()
    turn_two = [*turn_one, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And now?"}]
    ids = render(resident, turn_two)
    second = engine.generate(resident, ids, greedy(8)).collect()
    # At least turn one's prompt: the system turn, the user's first message and what follows.
    assert second.cached_tokens >= len(render(resident, turn_one)[0]) - 2 > prefix_ids.shape[-1] + 5
    assert second.token_ids == reference_generate(resident, ids, 8)
    assert len(engine.cache) == 2  # the system prompt and turn one (turn two was not remembered)


def test_bad_requests_are_refused_before_any_work(llama, engine):
    _prefix_ids, prompt_ids = support_request(llama, "Hi")
    with pytest.raises(SamplingError, match="max_tokens: must be an integer from 1"):
        engine.generate(llama, prompt_ids, SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="has a context of"):
        engine.generate(llama, prompt_ids, greedy(llama.max_context))
    assert engine.cache.stats().queries == 0
