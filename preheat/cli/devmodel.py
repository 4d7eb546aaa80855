"""Build a small but real causal LM on disk, with no network.

Random weights, a real architecture, a real byte-level BPE tokenizer trained on the Python
standard library's source, and what an instruct model ships beside them: its own chat
template (with the special tokens it uses) and a ``generation_config.json`` naming every
end-of-turn id. The result is an ordinary ``save_pretrained`` folder loaded through the
same ``from_pretrained`` path production uses.

The architectures cover the attention layouts a server meets: grouped KV heads (llama),
q/k/v bias (qwen2), q/k norms (qwen3), a sliding window on every layer (mistral, phi3), a
mix of sliding and full layers with soft-capping-free local/global attention (gemma3), and
learned absolute positions with no chat template of its own (gpt2).
"""

from __future__ import annotations

import functools
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"


@dataclass(frozen=True)
class Flavour:
    """What an instruct model of an architecture ships: special tokens, template, stops."""

    special_tokens: tuple[str, ...]
    chat_template: str | None
    end_of_turn: str | None  # also an eos_token_id in generation_config.json


_LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Mistral and Gemma have no system role: the system prompt opens the first user turn.
_MISTRAL = (
    "{{ bos_token }}{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% if message['role'] == 'user' %}[INST] {% if loop.first and system %}{{ system }}\n\n{% endif %}"
    "{{ message['content'] }} [/INST]{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
_GEMMA = (
    "{{ bos_token }}{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.first and system %}{{ system }}\n\n{% endif %}{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_PHI3 = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

FLAVOURS = {
    "llama": Flavour(("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), _LLAMA3, "<|eot_id|>"),
    "qwen2": Flavour(("<|im_start|>", "<|im_end|>"), _CHATML, "<|im_end|>"),
    "qwen3": Flavour(("<|im_start|>", "<|im_end|>"), _CHATML, "<|im_end|>"),
    "mistral": Flavour(("[INST]", "[/INST]"), _MISTRAL, None),
    "gemma3": Flavour(("<start_of_turn>", "<end_of_turn>"), _GEMMA, "<end_of_turn>"),
    "phi3": Flavour(("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), _PHI3, "<|end|>"),
    "gpt2": Flavour((), None, None),
}
ARCHITECTURES = tuple(FLAVOURS)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    vocab_size: int = 8192
    sliding_window: int = 32  # mistral, phi3, gemma3: shorter than a template's prefix
    padded_vocab: int = 0  # embedding rows beyond the tokenizer's, as real checkpoints pad them


def _corpus(max_bytes: int) -> list[str]:
    """Deterministic training text: the stdlib's own .py files, in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


@functools.cache
def _trained_bpe(vocab_size: int, corpus_bytes: int) -> str:
    """The trained tokenizer as JSON (training is the slow part: done once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(corpus_bytes), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer.to_str()


def build_tokenizer(vocab_size: int, corpus_bytes: int = 2_000_000, arch: str = "llama"):
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_str(_trained_bpe(vocab_size, corpus_bytes))
    flavour = FLAVOURS[arch]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in flavour.special_tokens])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    if flavour.chat_template is not None:
        wrapped.chat_template = flavour.chat_template
    return wrapped


def build_config(arch: str, shape: ModelShape, tokenizer):
    import transformers

    if arch not in FLAVOURS:
        raise ValueError(f"unknown architecture {arch!r} (expected one of {', '.join(ARCHITECTURES)})")
    ids = dict(
        vocab_size=max(len(tokenizer), shape.padded_vocab),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=shape.hidden_size,
            n_inner=shape.intermediate_size,
            n_layer=shape.num_hidden_layers,
            n_head=shape.num_attention_heads,
            n_positions=min(shape.max_position_embeddings, 1024),
            **ids,
        )
    common = dict(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        **ids,
    )
    head_dim = shape.hidden_size // shape.num_attention_heads
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim, **common)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=shape.sliding_window, head_dim=head_dim, **common)
    if arch == "phi3":
        return transformers.Phi3Config(sliding_window=shape.sliding_window, **common)
    layers = ["sliding_attention"] * (shape.num_hidden_layers - 1) + ["full_attention"]
    return transformers.Gemma3TextConfig(
        sliding_window=shape.sliding_window, head_dim=head_dim, layer_types=layers, **common
    )


def _write_generation_config(folder: Path, arch: str, tokenizer) -> None:
    """Every id that ends a turn, as an instruct model's generation_config.json lists them."""
    end_of_turn = FLAVOURS[arch].end_of_turn
    eos = [tokenizer.eos_token_id] + ([tokenizer.convert_tokens_to_ids(end_of_turn)] if end_of_turn else [])
    config = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id}
    (folder / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _never_choose_padding(model, real_ids: int) -> None:
    """Rows past the tokenizer's ids score 0 while real ids' random scores reach well above
    it, so greedy decoding never picks an id that decodes to nothing (a trained checkpoint's
    padded rows are never chosen either)."""
    import torch

    with torch.no_grad():
        model.get_output_embeddings().weight[real_ids:] = 0


def make_model(folder: Path, arch: str = "llama", shape: ModelShape = ModelShape(), seed: int = 0) -> Path:
    """Write a loadable model folder and return it. Deterministic for a given seed."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty")
    if arch not in FLAVOURS:
        raise ValueError(f"unknown architecture {arch!r} (expected one of {', '.join(ARCHITECTURES)})")
    tokenizer = build_tokenizer(shape.vocab_size, arch=arch)
    config = build_config(arch, shape, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    _never_choose_padding(model, len(tokenizer))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _write_generation_config(folder, arch, tokenizer)
    return folder
