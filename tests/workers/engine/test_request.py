"""A request's per-token rules, on the production scheduler: greedy answers token-identical
to transformers' own `generate` on the chat-templated ids for every dev architecture,
sampling seeded as transformers samples, stop strings, every eos id of
generation_config.json, logprobs, logit bias, penalties, a conversation remembered. Then the
rules alone, with logits made by hand: the text released, stop strings held back, why a
request ends, what it leaves cached."""

from __future__ import annotations

import random

import pytest
import torch

from preheat.api.sampling import SamplingError, SamplingParams
from preheat.cli.devmodel import ARCHITECTURES, FLAVOURS
from preheat.workers.engine.chat import conversation, render
from preheat.workers.engine.request import AnswerText, Detokenizer, Request, RequestStatus, TextStream
from preheat.workers.engine.resident import ContextLengthError
from preheat.workers.engine.sampling import OutputTokenPenalty
from tests.conftest import SUPPORT_PROMPT, greedy, load_resident, reference_generate, support_request

USER_INPUTS = ["Where is my parcel? It was due on Monday.", "", "x" * 300, "Ünïcødé ✓ 包裹"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def resident(request, dev_model):
    return load_resident(dev_model(request.param), name=request.param)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return load_resident(tiny_model, name="llama")


def ask(scheduler, resident, prompt_ids, sampling, **how):
    return scheduler.submit(resident, prompt_ids, sampling, **how).collect()


# Through the scheduler, against transformers ------------------------------------------


@pytest.mark.parametrize("user_input", USER_INPUTS)
def test_greedy_output_from_the_cached_prefix_is_token_identical_to_transformers(resident, scheduler, user_input):
    prefix_ids, prompt_ids = support_request(resident, user_input)
    messages = conversation(SUPPORT_PROMPT, user_input)
    expected_ids = resident.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert prompt_ids[0].tolist() == list(expected_ids["input_ids"])
    scheduler.prefill(resident, prefix_ids, label="support")

    warm = ask(scheduler, resident, prompt_ids, greedy(24))
    cold = ask(scheduler, resident, prompt_ids, greedy(24), use_cache=False)

    assert warm.cached_tokens == prefix_ids.shape[-1] and cold.cached_tokens == 0
    assert warm.token_ids == cold.token_ids == reference_generate(resident, prompt_ids, 24)
    assert warm.text == resident.tokenizer.decode(warm.token_ids, skip_special_tokens=True)


def test_a_stop_string_across_a_token_boundary_ends_the_answer_and_is_never_released(llama, scheduler):
    _, prompt_ids = support_request(llama, "Where is my parcel?")
    free = ask(scheduler, llama, prompt_ids, greedy(24))
    # A stop string that starts inside one token and ends inside the next, where it first occurs.
    pieces = [llama.tokenizer.decode([t]) for t in free.token_ids]
    ends = [sum(len(p) for p in pieces[: i + 1]) for i in range(len(pieces))]
    at, start, stop = next(
        (i, ends[i] - 1, free.text[ends[i] - 1 : ends[i] + 1])
        for i in range(1, len(pieces) - 1)
        if len(pieces[i]) >= 2 and pieces[i + 1] and free.text.find(free.text[ends[i] - 1 : ends[i] + 1]) == ends[i] - 1
    )

    stream = scheduler.submit(llama, prompt_ids, greedy(24, stop=(stop, "never seen")))
    released = [piece.text for piece in stream]
    done = stream.completion
    assert done.finish_reason == "stop" and done.text == free.text[:start] == "".join(released)
    assert not any(stop in piece for piece in released)
    # It ends at the token that completes the stop string: no decoding past it.
    assert done.token_ids == free.token_ids[: len(done.token_ids)] and len(done.token_ids) == at + 2


def test_every_eos_id_of_generation_config_ends_the_answer(llama, scheduler):
    """<|eot_id|> is not the tokenizer's eos: only generation_config.json names it. A bias
    as OpenAI's examples write it (an integer) forces it."""
    end_of_turn = llama.tokenizer.convert_tokens_to_ids(FLAVOURS["llama"].end_of_turn)
    assert end_of_turn != llama.tokenizer.eos_token_id
    _, prompt_ids = support_request(llama, "Hi")
    done = ask(scheduler, llama, prompt_ids, greedy(10, logit_bias=((end_of_turn, 100),)))
    assert done.token_ids == [end_of_turn] and done.finish_reason == "stop" and done.text == ""


def test_a_forbidding_bias_is_transformers_sequence_bias(llama, scheduler):
    _, prompt_ids = support_request(llama, "Where is my parcel?")
    first = ask(scheduler, llama, prompt_ids, greedy(12)).token_ids
    banned = sorted(set(first))[:3]
    done = ask(scheduler, llama, prompt_ids, greedy(12, logit_bias=tuple((t, -100.0) for t in banned)))
    assert not set(done.token_ids) & set(banned)
    assert (
        done.token_ids
        == reference_generate(
            llama,
            prompt_ids,
            12,
            sequence_bias={(t,): -100.0 for t in banned},
            eos_token_id=llama.tokenizer.eos_token_id,
        )[: len(done.token_ids)]
    )


def test_a_bias_outside_the_vocabulary_is_refused_before_any_work(llama, scheduler):
    _, prompt_ids = support_request(llama, "Hi")
    with pytest.raises(SamplingError, match="logit_bias: token id 99999999 is not one of model llama's"):
        scheduler.submit(llama, prompt_ids, greedy(4, logit_bias=((99_999_999, 5.0),)))
    assert scheduler.prefixes.cache.stats().queries == 0


def test_seeded_sampling_draws_as_transformers_does_and_each_choice_has_its_own(llama, scheduler):
    prefix_ids, prompt_ids = support_request(llama, "Where is my parcel?")
    scheduler.prefill(llama, prefix_ids)
    asked = SamplingParams(max_tokens=16, temperature=0.7, top_k=40, top_p=0.9, seed=1)
    first = ask(scheduler, llama, prompt_ids, asked)
    again = ask(scheduler, llama, prompt_ids, asked)
    cold = ask(scheduler, llama, prompt_ids, asked, use_cache=False)
    assert first.token_ids == again.token_ids == cold.token_ids
    torch.manual_seed(1)  # transformers draws from the global generator: the same seed, the same draws
    theirs = reference_generate(llama, prompt_ids, 16, do_sample=True, temperature=0.7, top_k=40, top_p=0.9)
    assert first.token_ids == theirs[: len(first.token_ids)]
    others = {tuple(ask(scheduler, llama, prompt_ids, asked.for_choice(i)).token_ids) for i in range(1, 4)}
    assert len(others | {tuple(first.token_ids)}) > 1


def test_the_repetition_penalty_is_transformers_own(llama, scheduler):
    _, prompt_ids = support_request(llama, "Say it again and again")
    done = ask(scheduler, llama, prompt_ids, greedy(16, repetition_penalty=1.3))
    assert done.token_ids == reference_generate(llama, prompt_ids, 16, repetition_penalty=1.3)


def test_presence_and_frequency_penalties_equal_the_rule_applied_to_the_models_own_logits(llama, scheduler):
    """OpenAI's penalties (transformers has none): the reference recomputes every step from
    scratch with the model, applies logit -= frequency * count + presence * (count > 0)
    over the generated tokens, and takes the argmax."""
    _, prompt_ids = support_request(llama, "Say it again and again")
    done = ask(scheduler, llama, prompt_ids, greedy(12, presence_penalty=1.5, frequency_penalty=0.8))
    penalty, ids = OutputTokenPenalty(1.5, 0.8, prompt_ids.shape[-1]), prompt_ids
    expected = []
    with torch.inference_mode():
        for _ in range(len(done.token_ids)):
            logits = llama.model(input_ids=ids).logits[:, -1].float()
            token = int(penalty(ids, logits).argmax())
            expected.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=-1)
    assert done.token_ids == expected


def test_logprobs_are_the_models_own_distribution(llama, scheduler):
    _, prompt_ids = support_request(llama, "Hi")
    done = ask(scheduler, llama, prompt_ids, greedy(5, logprobs=3))
    assert [lp.token_id for lp in done.logprobs] == done.token_ids
    with torch.inference_mode():
        full = torch.cat([prompt_ids, torch.tensor([done.token_ids])], dim=-1)
        expected = torch.log_softmax(llama.model(input_ids=full).logits[0].float(), dim=-1)
    for step, lp in enumerate(done.logprobs):
        row = expected[prompt_ids.shape[-1] - 1 + step]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the most likely
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_remembered_turn_serves_the_next_turn_beyond_the_system_prompt(arch, dev_model, scheduler):
    resident = load_resident(dev_model(arch), name=arch)
    prefix_ids, _ = support_request(resident, "")
    scheduler.prefill(resident, prefix_ids, pin=True)
    turn_one = conversation(SUPPORT_PROMPT, "Where is my parcel?")
    first = ask(scheduler, resident, render(resident, turn_one), greedy(8), remember=True)
    turn_two = [*turn_one, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And now?"}]
    ids = render(resident, turn_two)
    second = ask(scheduler, resident, ids, greedy(8))
    # At least turn one's prompt: the system turn, the user's first message and what follows.
    assert second.cached_tokens >= len(render(resident, turn_one)[0]) - 2 > prefix_ids.shape[-1] + 5
    assert second.token_ids == reference_generate(resident, ids, 8)
    assert len(scheduler.prefixes.cache) == 2  # the system prompt and turn one (turn two was not remembered)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_turn_past_a_sliding_window_leaves_its_prompt_for_the_next_turn(arch, dev_model, scheduler):
    """No system prompt, a window the answer slides past: the prompt + answer can no longer
    be cut back, so the prompt's own KV, kept at its pre-fill, serves the next turn."""
    resident = load_resident(dev_model(arch), name=arch)
    turn_one = [{"role": "user", "content": "Where is my parcel? It was due on Monday."}]
    prompt = render(resident, turn_one)
    first = ask(scheduler, resident, prompt, greedy(40), remember=True)
    window = resident.model.config.get_text_config().sliding_window
    assert prompt.shape[-1] < window < prompt.shape[-1] + len(first.token_ids)  # the case that matters
    turn_two = [*turn_one, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And now?"}]
    ids = render(resident, turn_two)
    second = ask(scheduler, resident, ids, greedy(8))
    assert second.cached_tokens >= prompt.shape[-1] - 2 > 0
    assert second.token_ids == reference_generate(resident, ids, 8)


def test_bad_requests_are_refused_before_any_work(llama, scheduler):
    _prefix_ids, prompt_ids = support_request(llama, "Hi")
    with pytest.raises(SamplingError, match="max_tokens: must be an integer from 1"):
        scheduler.submit(llama, prompt_ids, SamplingParams(max_tokens=0))
    with pytest.raises(ContextLengthError, match="has a context of"):
        scheduler.submit(llama, prompt_ids, greedy(llama.max_context))
    assert scheduler.prefixes.cache.stats().queries == 0


def test_streaming_yields_the_text_in_pieces_and_the_entry_is_held_only_while_it_is_cloned(llama, scheduler):
    prefix_ids, prompt_ids = support_request(llama, "Tell me more.")
    entry = scheduler.prefill(llama, prefix_ids).entry
    stream = scheduler.submit(llama, prompt_ids, greedy(12))
    pieces = []
    for piece in stream:
        pieces.append(piece.text)
        assert entry.ref_count == 0  # the request reads its clone: the entry may go
    assert "".join(pieces) == stream.completion.text
    assert stream.completion.ttft_ms > 0 and stream.completion.total_ms >= stream.completion.ttft_ms


# The rules alone ----------------------------------------------------------------------


def _decode_all(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _incremental(tokenizer, prompt: list[int], answer: list[int]) -> str:
    ids = list(prompt)
    detokenizer = Detokenizer(tokenizer, ids, len(prompt))
    text = []
    for token in answer:
        ids.append(token)
        text.append(detokenizer.step())
    return "".join(text) + detokenizer.rest()


def _metaspace_tokenizer():
    """A sentencepiece-style tokenizer (Metaspace: a word's leading space is part of its
    token, and dropped at the start of a text), trained here: a decoder whose reading of
    a token depends on where it stands."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    corpus = [SUPPORT_PROMPT, "Where is my parcel? It was due on Monday.", "Ünïcødé ✓ 包裹 é日本"] * 20
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")


def test_incremental_text_equals_one_decode_of_the_whole_answer(dev_model, llama):
    """Byte-level BPE (every dev architecture: characters split across tokens) and a
    sentencepiece-style decoder (a leading space read by position), on random answers."""
    tokenizers = [load_resident(dev_model(arch), name=arch).tokenizer for arch in ("llama", "gemma3")]
    tokenizers.append(_metaspace_tokenizer())
    draw = random.Random(7)
    for tokenizer in tokenizers:
        size = len(tokenizer)
        prompt = tokenizer("You answer questions.")["input_ids"]
        for _ in range(60):
            answer = [draw.randrange(size) for _ in range(draw.randrange(1, 40))]
            assert _incremental(tokenizer, prompt, answer) == _decode_all(tokenizer, answer), answer
        text = "Ünïcødé ✓ 包裹 and  two  spaces\n\nthen more"
        answer = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert _incremental(tokenizer, prompt, answer) == _decode_all(tokenizer, answer) != ""


class _Text:
    """A detokenizer stand-in that yields given pieces of text, one per token."""

    def __init__(self, pieces: list[str]) -> None:
        self._pieces, self._rest = iter(pieces), ""

    def step(self) -> str:
        return next(self._pieces)

    def rest(self) -> str:
        return self._rest


def test_text_that_may_begin_a_stop_string_is_held_until_it_cannot():
    answer = AnswerText(_Text(["Hello wo", "r", "ld. E", "N", "D here"]), ("END", "world!"))
    released = [answer.add(None) for _ in range(5)]
    assert [p.text if p else None for p in released] == ["Hello ", None, "world. ", None, None]
    assert answer.stopped and "".join(answer.released) == "Hello world. "


def test_the_earliest_stop_string_wins_and_what_is_held_comes_out_at_the_end():
    answer = AnswerText(_Text(["ab", "cd"]), ("cd", "b"))
    assert answer.add(None).text == "a" and answer.stopped
    held = AnswerText(_Text(["to E"]), ("END",))
    assert held.add(None).text == "to " and not held.stopped
    assert held.finish().text == "E"  # the answer ended: the held text is the answer's


def _request(resident, max_tokens=3, **how) -> Request:
    prompt = torch.tensor([[resident.tokenizer.bos_token_id, 5, 6]])
    return Request(resident, prompt, greedy(max_tokens), **how)


def _logits_for(resident, token: int) -> torch.Tensor:
    logits = torch.zeros(resident.vocab_size)
    logits[token] = 10.0
    return logits


def test_why_a_request_ends_is_decided_token_by_token(llama):
    seen = []
    request = _request(llama, max_tokens=3)
    request.on_first_token = seen.append
    assert not request.append_token(40, None, _logits_for(llama, 40)) and seen == [request] and request.ttft_ms > 0
    assert not request.append_token(41, None, _logits_for(llama, 41)) and len(seen) == 1
    assert request.append_token(42, None, _logits_for(llama, 42)) and request.status is RequestStatus.FINISHED_LENGTH
    completion = request.finish()
    assert completion.token_ids == [40, 41, 42] and completion.finish_reason == "length"
    assert completion.text == llama.tokenizer.decode([40, 41, 42], skip_special_tokens=True)

    for eos in llama.stop_token_ids:
        ended = _request(llama, max_tokens=9)
        assert ended.append_token(eos, None, _logits_for(llama, eos)) and ended.status is RequestStatus.FINISHED_STOPPED
    gone = _request(llama, max_tokens=9)
    gone.cancel()
    assert gone.append_token(40, None, _logits_for(llama, 40)) and gone.status is RequestStatus.FINISHED_ABORTED


def test_a_stream_reads_pieces_then_the_completion_and_a_reader_gone_cancels(llama):
    request = _request(llama, max_tokens=2)
    stream = TextStream(request)
    request.append_token(40, None, _logits_for(llama, 40))
    request.append_token(41, None, _logits_for(llama, 41))
    request.finish()
    assert "".join(piece.text for piece in stream) == stream.completion.text
    assert not request.cancelled.is_set()

    early = _request(llama, max_tokens=5)
    reader = TextStream(early)
    early.append_token(40, None, _logits_for(llama, 40))
    for _ in reader:
        break  # the reader leaves after its first piece
    assert early.cancelled.is_set()


def test_what_a_finished_request_leaves_cached(llama):
    from transformers import DynamicCache

    remembered = _request(llama, max_tokens=2, remember=True)
    kv = DynamicCache(config=llama.model.config)
    remembered.append_token(40, None, _logits_for(llama, 40))
    remembered.append_token(41, None, _logits_for(llama, 41))
    ids, prefix = remembered.to_remember(kv)
    assert ids == [llama.tokenizer.bos_token_id, 5, 6, 40] and prefix.cache is kv  # all but the token never fed
    assert _request(llama).to_remember(kv) is None  # not asked to remember
    failed = _request(llama, max_tokens=2, remember=True)
    failed.append_token(40, None, _logits_for(llama, 40))
    failed.fail(RuntimeError("its own"))
    assert failed.to_remember(kv) is None
