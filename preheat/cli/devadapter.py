"""LoRA adapters made here for a model folder: random weights of a realistic rank on the
attention projections and the MLP, saved by PEFT as any fine-tune would be (the demo's,
the tests' and `preheat bench lora`'s; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

# The modules a LoRA fine-tune of a Llama-shaped model targets (q/k/v/o and the MLP).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    model_dir: Path, out: Path, *, rank: int = 16, alpha: int = 32, seed: int = 0, std: float = 0.02
) -> Path:
    """A PEFT LoRA adapter of `model_dir` in `out` (adapter_config.json and
    adapter_model.safetensors). B is not zero (PEFT's init would make the adapter a no-op):
    every weight is drawn with `std`, so the adapter changes the answers, as a fine-tune does."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        from preheat.core.errors import ConfigError

        raise ConfigError("making an adapter needs PEFT: pip install 'preheat[lora]'") from None

    if (out / "adapter_model.safetensors").is_file():
        return out
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    present = {name.rsplit(".", 1)[-1] for name, _ in base.named_modules()}
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=[name for name in TARGETS if name in present],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return out
