"""Chat templates: the ids every request has are the model's own template's, a template's
cached prefix is what every conversation with its system prompt shares, and the catalog
may replace a model's template (or preheat's default stands in for a missing one)."""

from __future__ import annotations

import pytest

from preheat.cli.devmodel import ARCHITECTURES
from preheat.core.catalog import load_catalog
from preheat.workers.engine.chat import ChatTemplateError, TemplatePrefix, conversation, render
from preheat.workers.engine.resident import DEFAULT_CHAT_TEMPLATE_NAME, ModelSource, ResidentModels
from preheat.workers.runtime import RuntimeConfig, WorkerRuntime
from tests.conftest import SUPPORT_PROMPT, load_resident, write_catalog

CONVERSATIONS = [
    [{"role": "user", "content": "Where is my parcel?"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "\n\nStarts with blank lines"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! Your tracking number?"},
        {"role": "user", "content": "AB123"},
    ],
]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_prefix_is_the_rendered_ids_every_conversation_shares(arch, dev_model):
    resident = load_resident(dev_model(arch), name=arch)
    prefix = TemplatePrefix.of(resident, SUPPORT_PROMPT)
    for turns in CONVERSATIONS:
        messages = [{"role": "system", "content": SUPPORT_PROMPT}, *turns]
        ids = render(resident, messages)
        expected = resident.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        assert ids[0].tolist() == list(expected["input_ids"])
        assert ids[0, : prefix.ids.shape[-1]].tolist() == prefix.ids[0].tolist()
    # The system prompt's words are in the prefix, whatever the template does with them.
    assert "Acme Parcel" in resident.tokenizer.decode(prefix.ids[0])
    assert prefix.ids.shape[-1] > 40


def test_a_model_without_a_template_uses_the_documented_default(dev_model, tmp_path):
    resident = load_resident(dev_model("gpt2"), name="gpt2")
    assert resident.chat_template_source == DEFAULT_CHAT_TEMPLATE_NAME
    text = resident.tokenizer.decode(render(resident, conversation("Be kind.", "Hi"))[0])
    assert text == "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    catalog = load_catalog(write_catalog(tmp_path, dev_model("gpt2")))
    assert catalog.chat_template_source("tiny") == "preheat's default (ChatML): the model has none"
    llama = load_catalog(write_catalog(tmp_path, dev_model("llama")))
    assert llama.chat_template_source("tiny").startswith("the model's own (")


def test_the_catalog_replaces_a_models_template_inline_or_from_a_file(dev_model, tmp_path):
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>")
    path = tmp_path / "preheat.toml"
    path.write_text(f'[models.tiny]\npath = "{dev_model("qwen3")}"\nchat_template_file = "plain.jinja"\n')
    catalog = load_catalog(path)
    runtime = WorkerRuntime(catalog, RuntimeConfig(device="cpu"))
    resident, _ = runtime.resident_models.ensure(runtime.source("tiny"))
    assert resident.tokenizer.decode(render(resident, conversation("S", "U"))[0]) == "[system] S\n[user] U\n>"
    assert resident.chat_template_source == f"the catalog ({tmp_path / 'plain.jinja'})"
    inline = ModelSource(
        "t", str(dev_model("qwen3")), chat_template="{{ messages[-1]['content'] }}!", chat_template_source="x"
    )
    other, _ = ResidentModels("cpu").ensure(inline)
    assert other.tokenizer.decode(render(other, conversation(None, "U"))[0]) == "U!"


def test_a_template_that_refuses_the_messages_is_one_clear_error(dev_model):
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}x"
    resident, _ = ResidentModels("cpu").ensure(
        ModelSource("strict", str(dev_model("llama")), chat_template=strict, chat_template_source="test")
    )
    with pytest.raises(ChatTemplateError, match="refuses these messages: System role not supported"):
        TemplatePrefix.of(resident, SUPPORT_PROMPT)


HEADS = [
    {"role": "system", "content": SUPPORT_PROMPT},
    {"role": "system", "content": "Answer in English."},
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Where is my parcel?", "name": "ann"},
]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_messages_of_any_shape_are_the_templates_own_ids_and_answered_as_transformers(arch, dev_model, tmp_path):
    """Two system messages, a developer message, a named user, as a client sends them,
    through the protocol, the runtime and the scheduler: the prompt is what
    apply_chat_template makes of those messages, and the answer transformers' on it."""
    from preheat.api.requests import parse_chat
    from tests.conftest import reference_generate

    (tmp_path / "catalog.toml").write_text(
        f'[models.{arch}]\npath = "{dev_model(arch)}"\n\n'
        f'[templates.support]\nmodel = "{arch}"\nsystem_prompt = "{SUPPORT_PROMPT}"\n'
    )
    runtime = WorkerRuntime(load_catalog(tmp_path / "catalog.toml"), RuntimeConfig(device="cpu"))
    assert runtime.preload() == []
    asked = parse_chat({"model": arch, "messages": HEADS, "max_tokens": 8, "temperature": 0})
    done = runtime.generate_chat(arch, asked.messages, asked.sampling).collect()
    resident = runtime.resident_models.get(arch)
    ids = resident.tokenizer.apply_chat_template(HEADS, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert done.prompt_tokens == len(ids)
    assert done.token_ids == reference_generate(resident, render(resident, HEADS), 8)
    assert render(resident, asked.messages)[0].tolist() == list(ids)
    runtime.close()
