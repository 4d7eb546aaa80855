"""The router on real workers, Redis and Postgres: a conversation's next turn goes to the
worker that holds its earlier turn, to the shared queue when that worker is busy, and is
sent again when that worker dies with it queued; templates that do not fit one worker are
spread across the fleet, requests for them go to a holder, and the plan follows a worker
leaving. Every answer equals the same request answered on one worker."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import httpx
import pytest

from preheat.celery.queues import worker_queue
from preheat.core import processes
from preheat.core.errors import RequestRefused, UnknownNameError
from preheat.fleet.routing import Router, answered_keys, conversation_keys
from preheat.history.db import utcnow
from tests.conftest import SUPPORT_PROMPT, write_catalog

W1, W2 = "w1@route-test", "w2@route-test"
COURIER = "You are the dispatch assistant of a courier. Answer in one short sentence and name the depot."
GREEDY = {"temperature": 0, "max_tokens": 12}


def _parsed(messages: list[dict]) -> tuple[dict, ...]:
    """The messages as the route's schema reads them (what the router hashes)."""
    from preheat.api.requests import parse_chat

    return parse_chat({"model": "tiny", "messages": messages}).messages


def test_a_turns_answer_makes_the_key_its_next_turn_looks_up():
    turn1 = [{"role": "system", "content": COURIER}, {"role": "user", "content": "Where is parcel 7?"}]
    held = answered_keys("tiny", None, _parsed(turn1), "At the north depot.")
    turn2 = [*turn1, {"role": "assistant", "content": "At the north depot."}, {"role": "user", "content": "When?"}]
    looked_up = conversation_keys("tiny", None, _parsed(turn2))
    assert looked_up[0] == held[0]  # the whole earlier turn, longest first
    assert looked_up[-1] == held[-1]  # and the ad hoc system prompt, last
    # Another answer, another model, or the template form: another conversation.
    other = [*turn1, {"role": "assistant", "content": "At the south depot."}, {"role": "user", "content": "When?"}]
    assert conversation_keys("tiny", None, _parsed(other))[0] not in held
    assert conversation_keys("big", None, _parsed(turn2))[0] not in held
    assert conversation_keys("tiny", "support", _parsed(turn2))[0] not in held
    # Content given as text parts is the same text.
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in turn2]
    assert conversation_keys("tiny", None, _parsed(parts)) == looked_up


def test_the_keys_of_a_long_conversation_cost_one_pass_over_it(monkeypatch):
    """4,000 messages: every prefix ending with an answer keyed, each message serialized once
    (the keys were hashed prefix by prefix: quadratic, 3 s before anything was sent)."""
    from preheat.fleet import routing

    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(3999)]
    turns.append({"role": "user", "content": "last"})
    dumped = []
    real_dumps = routing.json.dumps
    monkeypatch.setattr(routing.json, "dumps", lambda *a, **k: dumped.append(1) or real_dumps(*a, **k))
    keys = conversation_keys("tiny", None, _parsed(turns))
    assert len(keys) == 1999 and len(set(keys)) == 1999  # every answer a key, each its own
    assert len(dumped) <= len(turns) + 2


def _router(**overrides):
    from preheat.celery.app import create_app
    from preheat.core.settings import Settings

    settings = Settings(**overrides)
    return Router(create_app(settings), settings)


def _serving(router, *names, model="tiny"):
    router._fleet = (0.0, {})  # read every pulse now
    fleet = router.fleet()
    return all(model in fleet.get(name, None).serving for name in names if name in fleet) and all(
        name in fleet for name in names
    )


def _content(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _on(router, worker: str, kwargs: dict) -> dict:
    """The same request answered on one worker, sent to its own queue directly."""
    return router.app.send_task("preheat.infer", kwargs=kwargs, queue=worker_queue(worker)).get(timeout=60)


@pytest.mark.slow
def test_a_conversation_follows_its_worker_falls_back_when_busy_and_is_resent_when_it_dies(
    services_stack, tiny_model, tmp_path
):
    stack = services_stack
    truth = _transformers(tiny_model)
    bounds = {"PREHEAT_MAX_RUNNING_REQUESTS": "2", "PREHEAT_ROUTE_MAX_WAITING": "1", "PREHEAT_ROUTE_TAKE_S": "2"}
    # No prefix store: one shared by both (a volume) would hand the other worker the ad hoc system
    # prompt the first pre-filled (turns are remembered in memory only), which this test compares.
    env = {**stack.env, **bounds, "OMP_NUM_THREADS": "1", "PREHEAT_PREFIX_STORE": "off"}
    w1 = processes.start_worker(W1, env, tmp_path / "logs", cwd=stack.home)
    w2 = processes.start_worker(W2, env, tmp_path / "logs", cwd=stack.home)
    with processes.running(w1, w2):
        router = _router(route_max_waiting=1, route_take_s=2)
        processes.poll(lambda: _serving(router, W1, W2), 120, what="both workers serving tiny")

        turn1 = [{"role": "system", "content": COURIER}, {"role": "user", "content": "Where is parcel 7?"}]
        first = router.send({"model": "tiny", "messages": turn1, **GREEDY})
        assert first.route.worker is None  # nobody holds it yet: the shared queue
        answer1 = first.get(60)
        holder = answer1["worker"]
        other = W2 if holder == W1 else W1
        # Refused as /v1/chat/completions refuses it: the status, code and message, one error.
        too_long = router.send({"model": "tiny", "messages": turn1, "max_tokens": 4096})
        with pytest.raises(RequestRefused, match=r"^400 context_length_exceeded: .*4096"):
            too_long.get(60)
        with pytest.raises(UnknownNameError, match="unknown model 'nope'"):
            router.send({"model": "nope", "messages": turn1})  # refused before it is sent

        # Turns 2 and 3 go to the worker that answered turn 1, from its remembered turn.
        history, previous = turn1, answer1
        for question in ("When will it arrive?", "Can I collect it there?"):
            history = [*history, {"role": "assistant", "content": _content(previous)}]
            history.append({"role": "user", "content": question})
            kwargs = {"model": "tiny", "messages": history, **GREEDY}
            call = router.send(kwargs)
            assert (call.route.worker, call.route.reason) == (holder, "holds the conversation")
            answer = call.get(60)
            assert answer["worker"] == holder
            elsewhere = _on(router, other, kwargs)
            assert _content(answer) == _content(elsewhere) == truth(history)  # as on one worker, as transformers
            # All of the turn before but at most its last id; the other worker, which answered
            # none of this conversation before, the system prompt alone (later it holds the
            # turn it was just asked to answer).
            assert _cached(answer) >= previous["usage"]["prompt_tokens"] - 1
            if previous is answer1:
                assert _cached(elsewhere) < _cached(answer)
            previous = answer

        # The holder counts the turns routed to it apart from the shared queue's (its /metrics).
        holder_proc = _proc(holder, w1, w2)
        assert _taken(holder_proc, "own") >= 2 and _taken(holder_proc, "shared") >= 1

        # The holder stops (open, no bytes) while it runs a turn: once its pulse is stale the
        # turn is sent again to the shared queue and answered there, as transformers answers it.
        history = [*history, {"role": "assistant", "content": _content(answer)}]
        long_turn = {**GREEDY, "model": "tiny", "messages": [*history, {"role": "user", "content": "More?"}]}
        long_turn["max_tokens"] = 400
        running = router.send(long_turn)
        assert running.route.worker == holder
        processes.poll(lambda: running.result.state == "STARTED", 30, 0.02, what="the long turn started")
        os.killpg(_proc(holder, w1, w2).popen.pid, signal.SIGSTOP)
        try:
            resent = running.get(90)
        finally:
            os.killpg(_proc(holder, w1, w2).popen.pid, signal.SIGCONT)
        assert running.routes[-1].reason == f"re-sent: {holder} stopped beating while running it"
        assert resent["worker"] == other
        reference = _transformers(tiny_model, max_tokens=400)
        assert _content(resent) == reference(long_turn["messages"])
        processes.poll(lambda: _idle(router, holder), 60, what=f"{holder} beating again, idle")

        # The holder stops taking: its bound's worth goes to it, then the next goes to the
        # shared queue; it is killed with them queued, and they are sent again to the shared
        # queue and answered by the other worker.
        kwargs = {"model": "tiny", "messages": [*history, {"role": "user", "content": "Thanks!"}], **GREEDY}
        expected = _content(_on(router, other, kwargs))
        assert expected == truth(kwargs["messages"])
        os.killpg(_proc(holder, w1, w2).popen.pid, signal.SIGSTOP)
        try:
            calls = [router.send(kwargs) for _ in range(4)]
            assert [c.route.worker for c in calls] == [holder, holder, holder, None]
            assert calls[3].route.reason.startswith(f"{holder} is busy (3 requests, bound 3)")
            processes.kill(_proc(holder, w1, w2))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(_proc(holder, w1, w2).popen.pid, signal.SIGCONT)
        answers = [call.get(60) for call in calls]
        assert {a["worker"] for a in answers} == {other}
        assert [_content(a) for a in answers] == [expected] * 4
        for call in calls[:3]:
            assert call.routes[-1].reason == f"re-sent: {holder} did not take it within 2 s"
            assert call.routes[-1].worker is None


def _taken(proc, queue: str) -> float:
    for line in httpx.get(f"{processes.health_url(proc)}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'preheat_requests_taken_total{{model="tiny",queue="{queue}"}} '):
            return float(line.split()[-1])
    raise AssertionError(f"no preheat_requests_taken_total for queue {queue}")


def _idle(router, worker: str) -> bool:
    router._fleet = (0.0, {})
    pulse = router.fleet().get(worker)
    return pulse is not None and router._fresh(pulse, utcnow()) and pulse.running == pulse.waiting == 0


def _transformers(model_dir, max_tokens: int = GREEDY["max_tokens"]):
    """What transformers' own generate answers (greedy) on the rendered messages."""
    from preheat.workers.engine.chat import render
    from tests.conftest import load_resident, reference_generate

    resident = load_resident(model_dir)

    def answer(messages: list[dict]) -> str:
        ids = reference_generate(resident, render(resident, messages), max_tokens)
        return resident.tokenizer.decode(ids, skip_special_tokens=True)

    return answer


def _proc(name, *candidates):
    return next(proc for proc in candidates if proc.name == name.split("@")[0])


TEMPLATES = {
    "billing": "You answer billing questions for Acme Parcel: invoices, refunds and charges only.",
    "code": "You review Python code for a courier's tracking service. Point out bugs first.",
    "support": None,  # the catalog's own
    "travel": "You plan delivery routes for Acme Parcel's vans across the city, shortest first.",
}


def _spread_catalog(stack, tiny_model):
    extra = "".join(
        f'\n[templates.{name}]\nmodel = "tiny"\nsystem_prompt = "{prompt}"\nprobe = "Hello?"\n'
        for name, prompt in TEMPLATES.items()
        if prompt
    )
    write_catalog(stack.catalog.parent, tiny_model, extra)


def _templates(stack) -> dict[str, dict]:
    listed = stack.cli("workers", "--json")
    assert listed.returncode == 0, listed.stderr
    return {w["nodename"]: w.get("templates") or {} for w in json.loads(listed.stdout) if w["state"] == "ready"}


def _settled(stack, expected: dict[str, list[str]]):
    shown = _templates(stack)
    return all(sorted(shown.get(w, {}).get("held") or []) == held for w, held in expected.items()) and len(
        shown
    ) == len(expected)


@pytest.mark.slow
def test_templates_that_do_not_fit_one_worker_are_spread_routed_to_a_holder_and_respread(
    services_stack, tiny_model, tmp_path
):
    stack = services_stack
    truth = _transformers(tiny_model)
    _spread_catalog(stack, tiny_model)
    # 4 entries, half of them pinnable: each worker pins 2 of the 4 templates.
    env = {**stack.env, "PREHEAT_KV_CACHE_MAX_ENTRIES": "4", "OMP_NUM_THREADS": "1"}
    w1 = processes.start_worker(W1, env, tmp_path / "logs", cwd=stack.home)
    w2 = processes.start_worker(W2, env, tmp_path / "logs", cwd=stack.home)
    with processes.running(w1, w2):
        # No traffic yet: the plan goes by name, emptiest worker first.
        plan = {W1: ["billing", "support"], W2: ["code", "travel"]}
        processes.poll(lambda: _settled(stack, plan), 120, what=f"the plan {plan}")
        for worker, templates in _templates(stack).items():
            assert sorted(templates["planned"]) == plan[worker]
        table = stack.cli("workers")
        assert "templates pinned" in table.stdout and all(name in table.stdout for name in TEMPLATES)
        planned = json.loads(stack.cli("templates", "plan", "--json").stdout)
        assert planned["spread"] is True
        assert {r["template"]: (r["planned_on"], r["held_by"]) for r in planned["templates"]} == {
            "billing": ([W1], [W1]),
            "support": ([W1], [W1]),
            "code": ([W2], [W2]),
            "travel": ([W2], [W2]),
        }
        assert "spread (the" in stack.cli("templates", "plan").stdout
        ranked = json.loads(stack.cli("templates", "rank", "--json").stdout)
        assert {r["template"]: r["held_by"] for r in ranked} == {
            "billing": [W1],
            "support": [W1],
            "code": [W2],
            "travel": [W2],
        }

        # A warmup follows the plan: each worker warms its share and skips the rest, saying why.
        warmed = stack.cli("warm", "--wait", "--json", "--timeout", "120")
        assert warmed.returncode == 0, warmed.stderr
        jobs = {(j["target"], j["template"]): j for j in json.loads(warmed.stdout)["jobs"]}
        for worker, share in plan.items():
            for template in TEMPLATES:
                job = jobs[(worker, template)]
                if template in share:
                    assert job["status"] in ("warm", "degraded"), job
                else:
                    assert (job["status"], job["error"]) == (
                        "skipped",
                        "not this worker's share of the fleet's template plan",
                    )

        router = _router()
        processes.poll(lambda: _serving(router, W1, W2), 60, what="both workers serving tiny")
        for template in TEMPLATES:
            holder = W1 if template in plan[W1] else W2
            kwargs = {"template": template, "messages": [{"role": "user", "content": "Hello?"}], **GREEDY}
            call = router.send(kwargs)
            assert (call.route.worker, call.route.reason) == (holder, f"holds template {template}")
            answer = call.get(60)
            assert answer["worker"] == holder and _cached(answer) > 0
            # The template form goes to the holder too, and answers as on one worker.
            legacy = {"template": template, "user_input": "Hello?", "max_tokens": 8, "temperature": 0.0}
            assert router.send(legacy).route.worker == holder
            other = W2 if holder == W1 else W1
            system = {"role": "system", "content": TEMPLATES[template] or SUPPORT_PROMPT}
            assert _content(answer) == _content(_on(router, other, kwargs)) == truth([system, *kwargs["messages"]])

        # w2 leaves: w1 alone pins the first two by the plan's order. It holds "code" now, and
        # is the only worker: such a request takes the shared queue, which w1 alone reads.
        processes.stop(w2)
        alone = {W1: ["billing", "code"]}
        processes.poll(lambda: _settled(stack, alone), 60, what=f"the plan {alone}")
        router._fleet = (0.0, {})
        call = router.send({"template": "code", "messages": [{"role": "user", "content": "Hi"}], **GREEDY})
        assert (call.route.worker, call.route.reason) == (None, "every worker holds template code")
        answer = call.get(60)
        assert answer["worker"] == W1 and _cached(answer) > 0


@pytest.mark.parametrize(
    ("messages", "named"),
    [
        (None, "messages must be a non-empty list"),
        (7, "messages must be a non-empty list"),
        ([{"role": "user", "content": [{"type": "text", "text": 7}]}], r"messages\[0\]\.content\[0\]\.text: must be"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role must be one of"),
    ],
)
def test_a_bad_chat_request_is_refused_by_the_router_naming_the_field_and_nothing_is_sent(
    embedded_stack, messages, named
):
    from preheat.celery.task import BadTaskArguments

    router = _router()
    sent = []
    router._send = lambda *args: sent.append(args)
    with pytest.raises(BadTaskArguments, match=named):
        router.send({"model": "tiny", "messages": messages})
    assert sent == []
    with pytest.raises(BadTaskArguments, match=r"messages\[0\]\.role: template 'support' gives the system prompt"):
        beside = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
        router.send({"template": "support", "messages": beside})


def test_bad_held_index_entries_are_skipped_and_never_block_or_flood_a_lookup(embedded_stack, tmp_path):
    """A FIFO planted as a key's file, bytes that are no text, an 8 MB value, a garbage
    longest key in front of a valid shorter one: each skipped, the valid entry found."""
    from preheat.fleet.routing import FileHeld

    held = FileHeld(tmp_path / "held", ttl_s=60)
    held.put(["good"], "w1@h")
    (tmp_path / "held" / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(tmp_path / "held" / "fifo")
    (tmp_path / "held" / "garbage").write_bytes(b"\xff\xfe\x00junk")
    (tmp_path / "held" / "huge").write_bytes(b"w" * 8_000_000)
    assert held.find(["fifo", "garbage", "huge", "good"]) == ("good", "w1@h")
    assert held.find(["fifo", "garbage", "huge"]) is None


@pytest.mark.slow
def test_bad_held_index_entries_in_redis_are_skipped(services_stack, redis_client):
    from preheat.fleet.routing import HELD_PREFIX, RedisHeld

    held = RedisHeld(services_stack.env["PREHEAT_BROKER_URL"], 60)
    held.put(["good"], "w1@h")
    redis_client.set(HELD_PREFIX + "garbage", b"\xff\xfe\x00junk")
    redis_client.set(HELD_PREFIX + "huge", b"w" * 8_000_000)
    redis_client.rpush(HELD_PREFIX + "alist", "w2@h")  # another type: an error for GETRANGE
    assert held.find(["garbage", "huge", "alist", "good"]) == ("good", "w1@h")
