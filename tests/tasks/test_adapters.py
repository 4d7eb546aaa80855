"""LoRA adapters on a real worker process: `preheat warm --adapter` warms an adapter's
template ahead of its tenants (a job per worker and template, recorded), and requests that
name an adapter as their model, through `preheat.infer`, answer as transformers + PEFT
(one from its pinned prefix, one read on demand)."""

from __future__ import annotations

import json

import httpx
import pytest

from preheat.cli.devadapter import make_adapter
from preheat.core import processes
from tests.conftest import SUPPORT_PROMPT
from tests.workers.engine.test_lora import peft_generate

pytestmark = pytest.mark.slow

WORKER = "w1@preheat-lora"


@pytest.fixture
def lora_worker(embedded_stack, tiny_model, tmp_path, apply_env):
    adapters = {
        name: make_adapter(tiny_model, tmp_path / "adapters" / name, rank=8, seed=i) for i, name in enumerate("ab")
    }
    catalog = tmp_path / "lora.toml"
    catalog.write_text(
        f'[models.tiny]\npath = "{tiny_model}"\nmax_adapters = 2\n[models.tiny.adapters]\n'
        + "".join(f'{name} = "{path}"\n' for name, path in adapters.items())
        + f'\n[templates.support-a]\nmodel = "tiny"\nadapter = "a"\nsystem_prompt = "{SUPPORT_PROMPT}"\n'
        'probe = "Where is my parcel?"\n'
    )
    embedded_stack.env.update(PREHEAT_CATALOG=str(catalog))
    apply_env(embedded_stack.env)
    proc = processes.start_worker(WORKER, embedded_stack.env, tmp_path / "logs", cwd=embedded_stack.home)
    with processes.running(proc):
        processes.wait_for_log(proc, "model tiny takes requests", 180)
        yield proc, adapters


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
