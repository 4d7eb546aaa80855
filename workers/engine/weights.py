"""How a model's weights reach memory: transformers' own loading, or the Run:ai Model Streamer.

transformers maps each safetensors file and copies tensors out of the mapping: from the page
cache that is as fast as memory (651 MB in 0.09-0.15 s on the 2-core CPU machine). The streamer
(`pip install 'preheat[fast-load]'`) reads the files with many threads at once, which is what
network volumes and object storage need, and is what GPU hosts use it for; from the page cache
on the CPU it is slower (0.53-0.79 s for the same 651 MB, `preheat bench start`), so `auto` takes
it only for a CUDA device.
The model built from streamed weights is the same model: same classes, same config, same
generation_config.json (tested against transformers' loading, logits compared exactly).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from preheat.core.errors import ModelLoadError
from preheat.workers.engine.device import Placement

LOADERS = ("auto", "transformers", "runai-streamer")
STREAMER_MISSING = (
    "PREHEAT_WEIGHT_LOADER=runai-streamer, but the Run:ai Model Streamer is not installed "
    "(pip install 'preheat[fast-load]')"
)


def streamer_installed() -> bool:
    return importlib.util.find_spec("runai_model_streamer") is not None


def pick_loader(preference: str, placement: Placement, path: str = "") -> str:
    """The loader a model is read with. An explicit choice is honoured or refused, never
    swapped for another; a GGUF file is read by transformers' GGUF loader alone."""
    if is_gguf(path):
        if preference not in ("auto", "transformers"):
            raise ModelLoadError(f"PREHEAT_WEIGHT_LOADER={preference} reads safetensors; {path} is a GGUF file")
        return "transformers"
    if preference not in LOADERS:
        raise ModelLoadError(f"PREHEAT_WEIGHT_LOADER must be one of {', '.join(LOADERS)}, got {preference!r}")
    if preference == "runai-streamer" and not streamer_installed():
        raise ModelLoadError(STREAMER_MISSING)
    if preference == "auto":
        return "runai-streamer" if placement.device.type == "cuda" and streamer_installed() else "transformers"
    return preference


# The model's own modules, as its code defines them: transformers 5.x swaps layers for Hub
# kernels by default where the `kernels` package is installed (seen on a CUDA host: a load
# that fetched from the Hub, which no worker reaches). preheat's steps replace the attention
# and the linear layers themselves, and nothing is fetched at run time.
_AS_IS = {"use_kernels": False}


def load_weights(path: str, placement: Placement, loader: str, onto: dict, pinned: dict):
    """The model at `path` with its weights in `placement.dtype` (moved to the device by the caller)."""
    from transformers import AutoModelForCausalLM

    if is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(**gguf_source(path), **_AS_IS, dtype=placement.dtype, **onto)
    if loader == "transformers":
        return AutoModelForCausalLM.from_pretrained(path, **_AS_IS, dtype=placement.dtype, **onto, **pinned)
    return _streamed(path, placement, pinned)


def is_gguf(path: str) -> bool:
    return Path(path).suffix == ".gguf"


def gguf_source(path: str) -> dict:
    """A GGUF file (llama.cpp's, Ollama's) as transformers loads it, dequantized: its folder and
    name. An architecture transformers cannot dequantize is one line naming it (the file's
    own `general.architecture`)."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF reader draws a progress bar per load
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError(f"{path}: reading GGUF needs the gguf package (pip install 'preheat[real]')") from None
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        field = GGUFReader(path).fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {architecture!r} is not one transformers can dequantize "
            f"(it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        )
    return {"pretrained_model_name_or_path": str(Path(path).parent), "gguf_file": Path(path).name}


def _streamed(path: str, placement: Placement, pinned: dict):
    from runai_model_streamer import SafetensorsStreamer
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if pinned:
        raise ModelLoadError(
            f"revision {pinned['revision']!r}: the streamer reads the files in the folder as they are; "
            "a pinned revision needs PREHEAT_WEIGHT_LOADER=transformers"
        )
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no .safetensors files: the streamer reads safetensors only")
    config = AutoConfig.from_pretrained(path)
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    state: dict = {}
    # Streamed to host memory, then copied to the device by the caller: the same route on
    # the CPU (tested) and on a GPU, where the parallel reads are what the streamer brings.
    with SafetensorsStreamer() as streamer:
        for file in files:
            streamer.stream_file(str(file))
        for name, tensor in streamer.get_tensors():
            state[name] = tensor
    # transformers takes a state dict only without a path; the config and the generation
    # defaults are read from the folder here instead.
    model = model_class.from_pretrained(None, config=config, state_dict=state, **_AS_IS, dtype=placement.dtype)
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model
