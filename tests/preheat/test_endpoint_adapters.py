"""LoRA adapters on a vLLM endpoint, against the fake vLLM (a real process speaking vLLM's
LoRA paths and bodies): a warmup loads each adapter ahead of its tenants, checks the server
lists it, and primes the adapter's templates under its name; a server without runtime LoRA
updating is one line in the job, and the base's templates are primed all the same."""

from __future__ import annotations

import httpx

from preheat.core.catalog import load_catalog
from preheat.endpoints.warmup import warm_endpoint
from tests.conftest import SUPPORT_PROMPT, write_catalog
from tests.preheat.test_endpoint_sleep import fake_vllm  # noqa: F401 - the fixture


def _catalog(tmp_path, tiny_model, url: str, adapter_dir) -> object:
    extra = (
        f'\n[templates.support-a]\nmodel = "tiny"\nadapter = "tenant-a"\nsystem_prompt = "{SUPPORT_PROMPT}"\n'
        f'\n[endpoints.vllm]\nbase_url = "{url}/v1"\nkind = "vllm"\nmodel = "fake-model"\n'
        'templates = ["support", "support-a"]\n'
        f'[endpoints.vllm.adapters]\ntenant-a = "{adapter_dir}"\n'
    )
    path = write_catalog(tmp_path, tiny_model, extra)
    text = path.read_text().replace(
        f'[models.tiny]\npath = "{tiny_model}"\n',
        f'[models.tiny]\npath = "{tiny_model}"\n[models.tiny.adapters]\ntenant-a = "{adapter_dir}"\n',
    )
    path.write_text(text)
    return load_catalog(path)


def _adapter(tmp_path):
    folder = tmp_path / "tenant-a"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    return folder


def test_a_warmup_loads_the_adapter_checks_it_is_listed_and_primes_its_template(fake_vllm, tmp_path, tiny_model):  # noqa: F811
    url = fake_vllm("--runtime-lora", "--enable-prompt-tokens-details")
    catalog = _catalog(tmp_path, tiny_model, url, _adapter(tmp_path))
    results = {
        r.template: r for r in warm_endpoint("vllm", catalog.endpoint("vllm"), catalog, ["support", "support-a"])
    }
    assert results["support-a"].model == "tenant-a" and results["support-a"].status == "warm", results[
        "support-a"
    ].error
    assert results["support"].model == "fake-model" and results["support"].status == "warm"
    listed = httpx.get(f"{url}/v1/models").json()["data"]
    assert {"id": "tenant-a", "parent": "fake-model"}.items() <= next(
        m for m in listed if m["id"] == "tenant-a"
    ).items()
    again = warm_endpoint("vllm", catalog.endpoint("vllm"), catalog, ["support-a"])  # loaded already: fine
    assert again[0].status == "warm" and again[0].cached_tokens > 0, again[0].error


def test_a_server_without_runtime_lora_is_one_line_and_the_base_is_primed(fake_vllm, tmp_path, tiny_model):  # noqa: F811
    url = fake_vllm("--enable-prompt-tokens-details")  # no --enable-lora / runtime updating: 404
    catalog = _catalog(tmp_path, tiny_model, url, _adapter(tmp_path))
    results = {
        r.template: r for r in warm_endpoint("vllm", catalog.endpoint("vllm"), catalog, ["support", "support-a"])
    }
    assert results["support-a"].status == "failed"
    assert results["support-a"].error == (
        "adapter 'tenant-a': POST /v1/load_lora_adapter is 404: start vLLM with --enable-lora and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
    )
    assert results["support"].status == "warm"


def test_a_path_the_server_cannot_load_is_its_message(fake_vllm, tmp_path, tiny_model):  # noqa: F811
    url = fake_vllm("--runtime-lora")
    catalog = _catalog(tmp_path, tiny_model, url, tmp_path / "nowhere")
    [result] = warm_endpoint("vllm", catalog.endpoint("vllm"), catalog, ["support-a"])
    assert result.status == "failed" and result.error.startswith(
        "adapter 'tenant-a': POST /v1/load_lora_adapter answered 400: Loading lora tenant-a failed: No adapter found"
    )
