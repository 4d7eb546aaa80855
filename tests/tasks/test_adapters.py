"""LoRA adapters on real worker processes: `preheat warm --adapter` and a schedule warm an
adapter's template ahead of its tenants (a job per worker and template, recorded), requests
that name an adapter as their model, through `preheat.infer`, answer as transformers + PEFT
(from its pinned prefix, or read on demand), and the router sends them to a worker that has
the adapter resident."""

from __future__ import annotations

import datetime as dt
import json

import httpx
import pytest

from preheat.cli.devadapter import make_adapter
from preheat.core import processes
from tests.conftest import SUPPORT_PROMPT
from tests.workers.engine.test_lora import peft_generate

pytestmark = pytest.mark.slow

WORKER, OTHER = "w1@preheat-lora", "w2@preheat-lora"
ADAPTER_TEMPLATES = {"a": "support-a", "b": "support-b"}


def _write_catalog(path, tiny_model, adapters: dict, templates: dict):
    path.write_text(
        f'[models.tiny]\npath = "{tiny_model}"\nmax_adapters = 4\n[models.tiny.adapters]\n'
        + "".join(f'{name} = "{folder}"\n' for name, folder in adapters.items())
        + "".join(
            f'\n[templates.{template}]\nmodel = "tiny"\nadapter = "{name}"\nsystem_prompt = "{SUPPORT_PROMPT}"\n'
            'probe = "Where is my parcel?"\n'
            for name, template in templates.items()
        )
    )
    return path


@pytest.fixture
def lora_adapters(embedded_stack, tiny_model, tmp_path, apply_env) -> dict:
    """Adapters a and b of the tiny model (PEFT, rank 8), each with a support template under it."""
    adapters = {
        name: make_adapter(tiny_model, tmp_path / "adapters" / name, rank=8, seed=i) for i, name in enumerate("ab")
    }
    catalog = _write_catalog(tmp_path / "lora.toml", tiny_model, adapters, ADAPTER_TEMPLATES)
    embedded_stack.env.update(PREHEAT_CATALOG=str(catalog))
    apply_env(embedded_stack.env)
    return adapters


@pytest.fixture
def lora_worker(embedded_stack, lora_adapters, tmp_path):
    proc = processes.start_worker(WORKER, embedded_stack.env, tmp_path / "logs", cwd=embedded_stack.home)
    with processes.running(proc):
        processes.wait_for_log(proc, "model tiny takes requests", 180)
        yield proc, lora_adapters


def _slots(stack, wanted) -> dict:
    """The worker's adapter slots of tiny, once its heartbeat reports them as `wanted`."""

    def read():
        [worker] = json.loads(stack.cli("workers", "--json").stdout)
        slots = worker["adapters"]["tiny"]
        return slots if wanted(slots) else None

    return processes.poll(read, 30, what="the adapter slots wanted")


def _answers_as_peft(answer: dict, tiny_model, adapter_folder, messages) -> None:
    from preheat.workers.engine.chat import render
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(ModelSource("tiny", str(tiny_model)))
    expected = peft_generate(tiny_model, adapter_folder, render(resident, messages), 8)
    assert answer["choices"][0]["message"]["content"] == resident.tokenizer.decode(expected, skip_special_tokens=True)


def test_an_adapter_is_warmed_ahead_and_its_requests_answer_as_peft(
    embedded_stack, lora_worker, tiny_model, embedded_app
):
    from preheat.fleet.routing import send_infer
    from preheat.workers.engine.chat import conversation, render
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    proc, adapters = lora_worker
    warmed = embedded_stack.cli("warm", "--adapter", "a", "--wait", "--json")
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    [job] = json.loads(warmed.stdout)["jobs"]
    assert (job["template"], job["status"], job["target"]) == ("support-a", "warm", WORKER)
    refused = embedded_stack.cli("warm", "--adapter", "nope")
    assert refused.returncode == 2 and "unknown adapter 'nope' (catalog has: a, b)" in refused.stderr
    refused = embedded_stack.cli("warm", "--adapter", "a", "--template", "support-b")
    assert refused.returncode == 2 and "no template named with --template is under adapter 'a'" in refused.stderr

    resident, _ = ResidentModels("cpu", dtype_preference="float32").ensure(ModelSource("tiny", str(tiny_model)))
    for adapter in ("a", "b"):  # a: from its pinned template prefix; b: read on demand
        messages = conversation(SUPPORT_PROMPT, "Where is my parcel?")
        call = send_infer(embedded_app, {"model": adapter, "messages": messages, "max_tokens": 8, "temperature": 0})
        answer = call.get(timeout=120)
        expected = peft_generate(tiny_model, adapters[adapter], render(resident, messages), 8)
        assert answer["choices"][0]["message"]["content"] == resident.tokenizer.decode(
            expected, skip_special_tokens=True
        )
        assert answer["model"] == adapter and answer["worker"] == WORKER
        if adapter == "a":
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    state = httpx.get(f"{processes.health_url(proc)}/health/ready").json()
    assert state == {"status": "ready"}
    metrics = httpx.get(f"{processes.health_url(proc)}/metrics").text
    assert 'preheat_adapter_requests_total{adapter="b",model="tiny"} 1.0' in metrics


def test_a_schedule_warms_adapters_ahead_of_a_compressed_peak_and_each_answers_from_its_pinned_prefix(
    embedded_stack, lora_worker, tiny_model, embedded_app
):
    """A peak a minute away: the schedule's slot fires (beat's own code), loads both adapters,
    pins them and pre-fills their templates; each tenant's first request is then answered from
    its adapter's pinned prefix, as transformers + PEFT, and counted under the adapter."""
    from preheat.fleet.routing import send_infer
    from preheat.history.db import session_scope, utcnow
    from preheat.schedules import beat, store
    from preheat.workers.engine.chat import conversation

    _, adapters = lora_worker
    # Off-peak: the model asleep, its adapters let go with it (read again at the wake).
    slept = embedded_stack.cli("sleep", "--wait", "--json")
    assert slept.returncode == 0, slept.stdout + slept.stderr
    assert _slots(embedded_stack, lambda slots: not slots["resident"])["pinned"] == []
    added = embedded_stack.cli("schedule", "add", "tenants", "--cron", "* * * * *", "--adapter", "a", "--adapter", "b")
    assert added.returncode == 0, added.stderr
    refused = embedded_stack.cli("schedule", "add", "x", "--cron", "* * * * *", "--adapter", "a", "--action", "sleep")
    assert refused.returncode == 2 and "--adapter is for warm schedules" in refused.stderr
    with session_scope() as session:
        schedule = store.get(session, "tenants")
        assert schedule.targets == {"templates": ["support-a", "support-b"]}
        schedule.active_since = utcnow() - dt.timedelta(minutes=2)  # its latest slot is due now
    assert list(beat.fire_due(utcnow(), "beat-test", grace_s=300, lease_s=15).values()) == ["sent"]
    with session_scope() as session:
        slot = next(slot for slot in store.recent_slots(session, "tenants") if slot.status == "sent")

    def finished():
        shown = json.loads(embedded_stack.cli("history", str(slot.run_id)[:8], "--json").stdout)
        run = shown[0] if isinstance(shown, list) else shown
        return run if run["status"] in ("succeeded", "degraded", "failed") else None

    run = processes.poll(finished, 120, what="the scheduled warmup")
    assert {(job["template"], job["status"]) for job in run["jobs"]} == {("support-a", "warm"), ("support-b", "warm")}

    pinned = _slots(embedded_stack, lambda slots: slots["pinned"] == ["a", "b"])
    assert sorted(pinned["resident"]) == ["a", "b"]

    for adapter in ("a", "b"):  # the peak: each tenant's first request
        messages = conversation(SUPPORT_PROMPT, f"Tenant {adapter}: where is my parcel?")
        kwargs = {"model": adapter, "messages": messages, "max_tokens": 8, "temperature": 0}
        answer = send_infer(embedded_app, kwargs).get(timeout=120)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its adapter's pinned prefix
        _answers_as_peft(answer, tiny_model, adapters[adapter], messages)


def test_a_request_naming_an_adapter_goes_to_the_worker_that_has_it_resident(
    embedded_stack, lora_adapters, tiny_model, embedded_app, tmp_path
):
    from preheat.celery.queues import worker_queue
    from preheat.fleet.routing import Router
    from preheat.workers.engine.chat import conversation

    # Only a has a template: every worker reads it at start; b is read where it is asked for.
    _write_catalog(tmp_path / "lora.toml", tiny_model, lora_adapters, {"a": "support-a"})
    env = {**embedded_stack.env, "OMP_NUM_THREADS": "1"}
    w1 = processes.start_worker(WORKER, env, tmp_path / "logs", cwd=embedded_stack.home)
    w2 = processes.start_worker(OTHER, env, tmp_path / "logs", cwd=embedded_stack.home)
    with processes.running(w1, w2):
        for proc in (w1, w2):
            processes.wait_for_log(proc, "model tiny takes requests", 180)
        # Adapter b read on w1 only: one request sent to w1's own queue.
        first = {"model": "b", "messages": conversation(SUPPORT_PROMPT, "Hello?"), "max_tokens": 2, "temperature": 0}
        assert (
            embedded_app.send_task("preheat.infer", kwargs=first, queue=worker_queue(WORKER)).get(60)["worker"]
            == WORKER
        )

        router = Router(embedded_app)

        def listed():  # w1's next pulse lists b (read afresh each time; nothing is sent meanwhile)
            router._fleet = (0.0, {})
            pulse = router.fleet().get(WORKER)
            return pulse is not None and "b" in pulse.adapters

        processes.poll(listed, 30, what="w1's pulse listing adapter b")
        messages = conversation(SUPPORT_PROMPT, "Which depot has my parcel?")
        kwargs = {"model": "b", "messages": messages, "max_tokens": 8, "temperature": 0}
        call = router.send(kwargs)
        assert (call.route.worker, call.route.reason) == (WORKER, "holds adapter b")
        answer = call.get(timeout=120)
        assert answer["worker"] == WORKER and answer["model"] == "b"
        _answers_as_peft(answer, tiny_model, lora_adapters["b"], messages)
        # Adapter a is resident on both (its template): the shared queue, and the route says why.
        other = router.send({**kwargs, "model": "a"})
        assert (other.route.worker, other.route.reason) == (None, "every worker holds adapter a")
        _answers_as_peft(other.get(timeout=120), tiny_model, lora_adapters["a"], messages)
