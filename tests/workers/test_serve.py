"""`preheat serve` as a real process, driven by the official `openai` client and by plain
HTTP: streaming, usage with cached prompt tokens, the warmup route's auth, bad input."""

from __future__ import annotations

import re

import httpx
import pytest
from openai import NotFoundError, OpenAI

from preheat import procs
from tests.conftest import SUPPORT_PROMPT, write_catalog

pytestmark = pytest.mark.slow

TOKEN = "serve-test-token"


@pytest.fixture
def server(embedded_stack, tmp_path):
    proc = procs.start_serve({**embedded_stack.env, "PREHEAT_SERVE_TOKEN": TOKEN}, tmp_path / "logs")
    with procs.running(proc):
        url = procs.serve_url(proc)
        procs.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 60, what="ready")
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
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens_details.cached_tokens
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
        ({"model": "tiny", "messages": user, "temperature": 0.7}, 400, "only greedy decoding"),
        ({"model": "tiny", "messages": user, "stop": ["\n"]}, 400, "stop: stop sequences are not served yet"),
        ({"model": "tiny", "messages": user, "tools": []}, 400, "tools: tool calls are not served"),
        ({"model": "tiny", "messages": user, "temprature": 0}, 400, "temprature: not a parameter"),
        ({"model": "tiny", "messages": []}, 400, "messages must be a non-empty list"),
        ({"model": "tiny", "messages": user, "max_tokens": 0}, 400, "max_tokens must be an integer from 1"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "role must be one of"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 5000}]}, 400, "has a context of"),
    ]
    for body, status, reason in cases:
        answer = httpx.post(chat, json=body, timeout=60)
        assert answer.status_code == status and reason in answer.json()["error"]["message"], (body, answer.text)
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
    proc = procs.start_serve(env, tmp_path / "logs")
    with procs.running(proc):
        url = procs.serve_url(proc)
        procs.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 60, what="ready")
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
    proc = procs.start_serve(embedded_stack.env, tmp_path / "logs")
    with procs.running(proc):
        url = procs.serve_url(proc)

        def only_gone_is_missing():
            reasons = httpx.get(f"{url}/health/ready", timeout=5).json().get("reasons", [])
            return [r.split(":")[0] for r in reasons] == ["model gone unavailable", "template orphan"]

        procs.poll(only_gone_is_missing, 60, what="tiny warm and gone reported")
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
