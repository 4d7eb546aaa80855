"""The real model on a real worker process: a conversation's turns routed to the worker holding
them and answered from all of the earlier turn, and a request to the sleeping model woken on
demand; every answer token for token what transformers gives on the same ids in float32."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from preheat.core import processes
from preheat.core.states import RunStatus

pytestmark = pytest.mark.slow

WORKER = "w1@preheat-real"
SYSTEM = "You are a concise assistant. Answer in one sentence."


@pytest.fixture
def real_worker(embedded_stack, real_model, tmp_path, apply_env):
    catalog = tmp_path / "real.toml"
    catalog.write_text(f'[models.smollm2]\npath = "{real_model}"\n')
    embedded_stack.env.update(PREHEAT_CATALOG=str(catalog))
    apply_env(embedded_stack.env)  # this process (the router's caller, the CLI) names the same catalog
    proc = processes.start_worker(WORKER, embedded_stack.env, tmp_path / "logs", cwd=embedded_stack.home)
    with processes.running(proc):
        processes.wait_for_log(proc, "model smollm2 takes requests", 300)
        yield proc


def transformers_answer(model_dir, messages, max_new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ids = torch.tensor([rendered["input_ids"]])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[-1] :], skip_special_tokens=True)


def test_a_routed_conversation_and_an_on_demand_wake_answer_as_transformers(
    embedded_stack, real_worker, real_model, embedded_app
):
    stack_app = embedded_app
    from preheat.fleet.routing import send_infer

    turn_one = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    first_call = send_infer(stack_app, {"model": "smollm2", "messages": turn_one, "max_tokens": 20, "temperature": 0})
    try:
        first = first_call.get(timeout=120)
    except Exception as exc:  # what the worker did, for a run where this is all one sees
        raise AssertionError(f"{exc!r}; the worker's log:\n{real_worker.log()[-4000:]}") from exc
    text = first["choices"][0]["message"]["content"]
    assert text == transformers_answer(real_model, turn_one, 20)
    turn_two = [*turn_one, {"role": "assistant", "content": text}, {"role": "user", "content": "And of Italy?"}]
    second_call = send_infer(stack_app, {"model": "smollm2", "messages": turn_two, "max_tokens": 16, "temperature": 0})
    second = second_call.get(timeout=120)
    assert second_call.route.worker == WORKER and second["worker"] == WORKER, second_call.route.reason
    # All of turn one (its prompt and answer, as the chat template re-renders them) came from the cache.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["total_tokens"] - 1
    assert second["choices"][0]["message"]["content"] == transformers_answer(real_model, turn_two, 16)

    slept = embedded_stack.cli("sleep", "--model", "smollm2", "--wait", "--json")
    assert slept.returncode == 0 and json.loads(slept.stdout)["status"] == "succeeded", slept.stderr
    health = f"{processes.health_url(real_worker)}/health/ready"
    assert httpx.get(health).json()["reasons"] == ["model smollm2: asleep (level 1)"]
    woken = send_infer(stack_app, {"model": "smollm2", "messages": turn_one, "max_tokens": 20, "temperature": 0})
    # Not to the worker that holds the prefix: its pulse said at once that it serves it no more.
    assert woken.route.worker is None, woken.route.reason
    assert woken.get(timeout=180)["choices"][0]["message"]["content"] == text  # woken on demand, same answer

    def demand_wake():  # the wake's record may land a moment after its answer: read until it has
        demand = json.loads(embedded_stack.cli("history", "--trigger", "demand", "--json").stdout)
        return demand and RunStatus(demand[0]["status"]).is_final and demand[0]

    wake = processes.poll(demand_wake, 60, every_s=1.0, what="the on-demand wake recorded")
    assert wake["action"] == "wake" and wake["status"] == "succeeded", wake
