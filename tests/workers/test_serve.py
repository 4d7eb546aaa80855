"""`preheat serve` as a real process, driven by the official `openai` client and by plain
HTTP: streaming, usage with cached prompt tokens, the warmup route's auth, bad input."""

from __future__ import annotations

import re

import httpx
import pytest
from openai import NotFoundError, OpenAI

from preheat.cli.devmodel import ARCHITECTURES
from preheat.core import processes
from preheat.workers.engine.resident import DEFAULT_CHAT_TEMPLATE
from tests.conftest import SUPPORT_PROMPT, write_catalog

pytestmark = pytest.mark.slow

TOKEN = "serve-test-token"


@pytest.fixture
def server(embedded_stack, tmp_path):
    proc = processes.start_serve({**embedded_stack.env, "PREHEAT_SERVE_TOKEN": TOKEN}, tmp_path / "logs")
    with processes.running(proc):
        url = processes.serve_url(proc)
        processes.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 60, what="ready")
        yield url, proc


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def warmup(url: str, token: str | None = TOKEN, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(f"{url}/internal/warmup", json=body, headers=headers, timeout=120)


def test_the_openai_client_streams_a_chat_completion_with_cached_prompt_tokens_after_a_warmup(server):
    url, _ = server
    warmed = warmup(url, templates=["support"], batch_size=2, max_tokens=4)
    assert warmed.status_code == 200, warmed.text
    measured = warmed.json()["templates"]["support"]
    assert measured["status"] == "warm" and measured["requests"]["count"] == 2
    assert measured["cached_tokens"] > 20 and measured["ttft_cold_ms"] > 0 and measured["ttft_warm_ms"] > 0

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SUPPORT_PROMPT}, {"role": "user", "content": "Where is my parcel?"}],
    )
    deltas, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert len([d for d in deltas if d]) >= 1 and finish in ("length", "stop")
    assert usage.prompt_tokens_details.cached_tokens == measured["cached_tokens"]
    assert usage.completion_tokens <= 6 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    whole = client.chat.completions.create(
        model="tiny",
        max_tokens=6,
        messages=[{"role": "system", "content": SUPPORT_PROMPT}, {"role": "user", "content": "Where is my parcel?"}],
    )
    assert whole.choices[0].message.content == "".join(deltas)  # greedy: the same text either way


def test_completions_and_ad_hoc_system_prompts_are_cached_for_the_next_request(server):
    url, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    plain = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3)
    assert plain.usage.completion_tokens >= 1 and plain.object == "text_completion"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3, stream=True)
        if c.choices
    )
    assert streamed == plain.choices[0].text

    ad_hoc = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Colour?"}]
    first = client.chat.completions.create(model="tiny", max_tokens=2, messages=ad_hoc)
    second = client.chat.completions.create(model="tiny", max_tokens=2, messages=ad_hoc)
    assert first.usage.prompt_tokens_details.cached_tokens > 0  # pre-filled on the miss, then used
    # The first left its prompt and answer cached: the same messages again compute only the
    # prompt's last token (whose logits the longer entry does not keep).
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_internal_warmup_without_or_with_a_wrong_token_is_401_and_runs_nothing(server):
    url, _ = server
    before = metric(url, 'preheat_prefills_total{model="tiny"}'), metric(url, "preheat_kv_cache_queries_total")
    for token in (None, "wrong-token", TOKEN[:-1]):
        refused = warmup(url, token=token, templates=["support"])
        assert refused.status_code == 401
        assert refused.json()["error"]["message"] == "a valid bearer token is required"
        assert refused.headers["WWW-Authenticate"].startswith("Bearer")
    assert (
        metric(url, 'preheat_prefills_total{model="tiny"}'),
        metric(url, "preheat_kv_cache_queries_total"),
    ) == before
    unknown = warmup(url, templates=["support", "nope"])
    assert unknown.status_code == 400 and "unknown template(s): nope" in unknown.json()["error"]["message"]


def test_bad_input_is_a_4xx_with_a_reason(server):
    url, _ = server
    chat = f"{url}/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ({"model": "nope", "messages": user}, 404, "model 'nope' does not exist here"),
        ({"model": "tiny", "messages": user, "temperature": 7}, 400, "temperature: must be in [0, 2]"),
        ({"model": "tiny", "messages": user, "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"model": "tiny", "messages": user, "tools": []}, 400, "tools: tool calls are not served"),
        ({"model": "tiny", "messages": user, "temprature": 0}, 400, "temprature: not a parameter"),
        ({"model": "tiny", "messages": []}, 400, "messages must be a non-empty list"),
        ({"model": "tiny", "messages": user, "max_tokens": 0}, 400, "max_tokens: must be an integer from 1"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "role must be one of"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 5000}]}, 400, "has a context of"),
        ({"model": "tiny", "messages": user, "stream": "false"}, 400, "stream: must be true or false"),
        ({"model": "tiny", "messages": user, "max_completion_tokens": 0}, 400, "max_completion_tokens: must be"),
        ({"model": "tiny", "messages": user, "logit_bias": {"99999999": 5}}, 400, "logit_bias: token id 99999999"),
        (
            {"model": "tiny", "messages": user, "logit_bias": {"99999999": 5}, "stream": True},
            400,
            "logit_bias: token id 99999999",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "content[0].text"),
    ]
    for body, status, reason in cases:
        answer = httpx.post(chat, json=body, timeout=60)
        assert answer.status_code == status and reason in answer.json()["error"]["message"], (body, answer.text)
    codes = {
        httpx.post(chat, json=body, timeout=60).json()["error"]["code"]
        for body in ({"model": "tiny", "messages": user, "temperature": 7}, {"model": "tiny", "messages": []})
    }
    assert codes == {"invalid_value"}  # the code follows the cause: no context was exceeded
    deep = httpx.post(chat, content=b'{"model": "tiny", "messages": ' + b"[" * 990 + b"]" * 990 + b"}", timeout=10)
    assert deep.status_code == 400 and "nested deeper than 64" in deep.json()["error"]["message"]
    not_json = httpx.post(chat, content=b"{nope", timeout=10)
    assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]["message"]
    not_utf8 = httpx.post(chat, content=b'{"model": "\xff"}', timeout=10)
    assert not_utf8.status_code == 400 and "not UTF-8" in not_utf8.json()["error"]["message"]
    too_big = httpx.post(chat, content=b" " * (2 * 1024**2), timeout=10)
    assert too_big.status_code == 413 and "the limit is 1048576" in too_big.json()["error"]["message"]
    assert httpx.get(f"{url}/v2/nothing", timeout=10).status_code == 404
    with pytest.raises(NotFoundError):
        OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(model="nope", messages=user)


# Bytes that are not UTF-8 text, or JSON that decodes to text that is not (a lone
# surrogate), on every route that reads a body, a header or a path: a 4xx with a reason.
NOT_TEXT = [
    (
        "POST",
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}]}',
        {},
        400,
        "not UTF-8",
    ),
    (
        "POST",
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        {},
        400,
        "not valid text",
    ),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "caf\xe9"}', {}, 400, "not UTF-8"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\\udcff"}', {}, 400, "not valid text"),
    ("POST", "/internal/warmup", b'{"templates": ["\xfe"]}', {"Authorization": f"Bearer {TOKEN}"}, 400, "not UTF-8"),
    (
        "POST",
        "/internal/warmup",
        b'{"templates": ["support"]}',
        {"Authorization": b"Bearer \xff\xfe"},
        401,
        "a valid bearer token is required",
    ),
    ("GET", "/v1/models/%FF%FE", b"", {}, 404, ""),
]


def test_bytes_that_are_not_text_are_a_4xx_with_a_reason(server):
    url, proc = server
    wrong = []
    for method, path, body, headers, status, reason in NOT_TEXT:  # one server for the table
        answer = httpx.request(method, f"{url}{path}", content=body, headers=headers, timeout=30)
        if answer.status_code != status or (reason and reason not in answer.json()["error"]["message"]):
            wrong.append((method, path, body, answer.status_code, answer.text))
    assert not wrong, wrong
    assert "Traceback" not in proc.log()


def test_an_api_key_guards_v1_and_internal_routes_are_off_without_a_token(embedded_stack, tmp_path):
    env = {**embedded_stack.env, "PREHEAT_SERVE_API_KEY": "client-key"}
    proc = processes.start_serve(env, tmp_path / "logs")
    with processes.running(proc):
        url = processes.serve_url(proc)
        processes.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 60, what="ready")
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 401
        ok = httpx.post(
            f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer client-key"}, timeout=30
        )
        assert ok.status_code == 200
        disabled = warmup(url, token="anything")
        assert disabled.status_code == 401 and "no PREHEAT_SERVE_TOKEN" in disabled.json()["error"]["message"]
    assert "client-key" not in proc.log()


def test_a_model_that_is_not_warm_takes_no_request(embedded_stack, tmp_path, tiny_model):
    write_catalog(
        tmp_path,
        tiny_model,
        '\n[models.gone]\npath = "does/not/exist"\n'
        '[templates.orphan]\nmodel = "gone"\nsystem_prompt = "You are lost."\n',
    )
    proc = processes.start_serve(embedded_stack.env, tmp_path / "logs")
    with processes.running(proc):
        url = processes.serve_url(proc)

        def only_gone_is_missing():
            reasons = httpx.get(f"{url}/health/ready", timeout=5).json().get("reasons", [])
            return [r.split(":")[0] for r in reasons] == ["model gone unavailable", "template orphan"]

        processes.poll(only_gone_is_missing, 60, what="tiny warm and gone reported")
        assert httpx.get(f"{url}/health/ready", timeout=5).status_code == 503
        refused = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=10,
            json={"model": "gone", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        assert "model 'gone' is not warm yet" in refused.json()["error"]["message"]
        served = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=30,
            json={"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert served.status_code == 200  # the other model serves


# Real instruct models through the official client -------------------------------------

CHAT_ARCHITECTURES = ARCHITECTURES  # every architecture devmodel builds
QUESTION = "Where is my parcel? It was due on Monday."


def reference_answer(model_dir, messages, max_new_tokens: int, **options) -> list[int]:
    """transformers alone: the model's chat template, then greedy generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor(
        [tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]]
    )
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id, **options
        )
    return out[0, ids.shape[-1] :].tolist()


@pytest.fixture
def chat_server(embedded_stack, tmp_path, dev_model):
    models = "".join(f'[models.{arch}]\npath = "{dev_model(arch)}"\n\n' for arch in CHAT_ARCHITECTURES)
    templates = "".join(
        f'[templates.support-{arch}]\nmodel = "{arch}"\nsystem_prompt = "{SUPPORT_PROMPT}"\n\n'
        for arch in CHAT_ARCHITECTURES
    )
    (tmp_path / "preheat.toml").write_text(models + templates)
    env = {**embedded_stack.env, "PREHEAT_CATALOG": str(tmp_path / "preheat.toml")}
    proc = processes.start_serve(env, tmp_path / "logs")
    with processes.running(proc):
        url = processes.serve_url(proc)
        processes.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 120, what="ready")
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), proc


def test_answers_equal_transformers_on_the_chat_templated_ids_for_every_architecture(chat_server, dev_model):
    client, proc = chat_server
    messages = [{"role": "system", "content": SUPPORT_PROMPT}, {"role": "user", "content": QUESTION}]
    for arch in CHAT_ARCHITECTURES:
        expected = reference_answer(dev_model(arch), messages, 12)
        tokenizer = load_tokenizer(dev_model(arch))
        whole = client.chat.completions.create(model=arch, messages=messages, max_tokens=12, temperature=0)
        streamed, finish = [], None
        for chunk in client.chat.completions.create(
            model=arch, messages=messages, max_tokens=12, temperature=0, stream=True
        ):
            if chunk.choices:
                streamed.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        text = tokenizer.decode(expected, skip_special_tokens=True)
        assert whole.choices[0].message.content == "".join(streamed) == text, arch
        assert whole.usage.completion_tokens == len(expected), arch
        assert whole.usage.prompt_tokens_details.cached_tokens > 20, arch  # the template's prefix at least
        assert finish == whole.choices[0].finish_reason, arch
        # Empty user input on a prefix longer than any sliding window: answered, streamed or not.
        empty = [{"role": "system", "content": SUPPORT_PROMPT}, {"role": "user", "content": ""}]
        assert client.chat.completions.create(model=arch, messages=empty, max_tokens=3, temperature=0).choices
        chunks = list(client.chat.completions.create(model=arch, messages=empty, max_tokens=3, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length"), arch
    assert "Traceback" not in proc.log()


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_a_conversation_turn_two_reuses_turn_one_and_sampling_is_reproducible(chat_server):
    client, _ = chat_server
    turn_one = [{"role": "system", "content": SUPPORT_PROMPT}, {"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="llama", messages=turn_one, max_tokens=8, temperature=0)
    system_only = first.usage.prompt_tokens_details.cached_tokens
    turn_two = [
        *turn_one,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Can you check again?"},
    ]
    second = client.chat.completions.create(model="llama", messages=turn_two, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2 > system_only

    # What most clients send: answered, the same way every time, ended at the newline.
    asked = dict(model="llama", messages=turn_one, max_tokens=64, temperature=0.7, top_p=0.9, seed=1)
    free = client.chat.completions.create(**asked)
    text = free.choices[0].message.content
    assert "\n" in text and free.choices[0].finish_reason == "length"
    stopped = [client.chat.completions.create(**asked, stop=["\n"]) for _ in range(2)]
    assert [s.choices[0].message.content for s in stopped] == [text[: text.find("\n")]] * 2
    assert stopped[0].choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(**asked, stop=["\n"], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.find("\n")]

    two = client.chat.completions.create(**{**asked, "n": 2})
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == text  # choice 0 has the seed itself
    assert two.choices[1].message.content != text  # its own seed (seed + 1)
    assert two.usage.prompt_tokens == free.usage.prompt_tokens  # one prompt, two answers


def test_logprobs_in_both_shapes_streamed_and_not(chat_server, dev_model):
    client, _ = chat_server
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy
    streamed = [
        t
        for chunk in client.chat.completions.create(
            model="llama", messages=messages, max_tokens=4, temperature=0, logprobs=True, stream=True
        )
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content]
    plain = client.completions.create(model="llama", prompt="Once upon a time", max_tokens=3, logprobs=1)
    assert len(plain.choices[0].logprobs.token_logprobs) == 3 and len(plain.choices[0].logprobs.top_logprobs[0]) == 1

    # A bias as OpenAI's own examples write it (an integer), through the server and the
    # scheduler, against transformers' sequence bias on the same ids.
    greedy = reference_answer(dev_model("llama"), messages, 6)
    banned = {(greedy[0],): -100.0, (greedy[1],): -100.0}
    expected = reference_answer(dev_model("llama"), messages, 6, sequence_bias=banned)
    integers = {str(greedy[0]): -100, str(greedy[1]): -100}
    biased = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=6, temperature=0, logit_bias=integers
    )
    tokenizer = load_tokenizer(dev_model("llama"))
    assert biased.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert biased.usage.completion_tokens == len(expected)


def test_every_damaged_prefix_file_is_computed_again_and_answers_as_transformers(embedded_stack, tmp_path, tiny_model):
    """What comes back from disk is proven, in a real server: prefix files written for a
    template each, then each damaged a different way (tests/workers/engine/test_prefixstore.py);
    every one is one log line and a pre-fill, and every answer is transformers' own."""
    from preheat.workers.engine.chat import TemplatePrefix
    from preheat.workers.engine.prefixstore import PrefixStore
    from tests.conftest import load_resident, new_scheduler, reference_generate
    from tests.workers.engine.test_prefixstore import DAMAGES

    prompts = {f"t{i}": f"{SUPPORT_PROMPT} You are desk number {i}." for i in range(len(DAMAGES))}
    catalog = tmp_path / "damaged.toml"
    catalog.write_text(
        f'[models.tiny]\npath = "{tiny_model}"\n\n'
        + "".join(f'[templates.{name}]\nmodel = "tiny"\nsystem_prompt = "{text}"\n\n' for name, text in prompts.items())
    )
    resident, store = load_resident(tiny_model), PrefixStore(tmp_path / "prefixes", 2**30)
    writer = new_scheduler(store)
    prefixes = {name: TemplatePrefix.of(resident, text) for name, text in prompts.items()}
    for prefix in prefixes.values():
        writer.prefill(resident, prefix.ids, key=prefix.key)
    store.flush()
    writer.close()
    for (name, prefix), damage in zip(prefixes.items(), DAMAGES.values(), strict=True):
        damage(store.path_for(resident, prefix.ids[0].numpy()), tmp_path / name, prefix.ids)
    env = {**embedded_stack.env, "PREHEAT_CATALOG": str(catalog), "PREHEAT_PREFIX_STORE": str(store.folder)}
    proc = processes.start_serve(env, tmp_path / "logs")
    with processes.running(proc):
        url = processes.serve_url(proc)
        processes.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 90, what="ready")
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for name, text in prompts.items():
            messages = [{"role": "system", "content": text}, {"role": "user", "content": QUESTION}]
            answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
            expected = reference_generate(resident, prefixes[name].prompt_ids(resident, QUESTION), 8)
            assert answer.choices[0].message.content == resident.tokenizer.decode(expected, skip_special_tokens=True)
            assert answer.usage.prompt_tokens_details.cached_tokens >= prefixes[name].ids.shape[-1]
        log = proc.log()
    assert log.count("is unusable") == len(DAMAGES), log
    assert "Traceback" not in log
