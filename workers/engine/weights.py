"""How a model's weights reach memory: read by name from its safetensors files, through
transformers' own loading, or by the Run:ai Model Streamer.

- **safetensors**: the model built by transformers from its config, its parameters left
  unfilled, then each filled from the tensor of the same name in the folder's safetensors
  files. It is for checkpoints that hold the model's own tensors as they are: every
  parameter once, by its own name and shape (a tied weight under its first name), nothing
  else, no quantization, an architecture whose read is compared with transformers' loading in
  the tests (`AS_NAMED`: logits, buffers, config and generation defaults alike). It skips
  what transformers' loading does for every model, 0.18 s of which builds its table of
  renamings for every architecture it knows: on 2 cores SmolLM2-135M's float32 file is read
  in 0.03 s against 0.14-0.22 s, and into bfloat16 in 0.14-0.17 s against 0.25-0.29 s
  (docs/benchmarks.md). A tensor already in the model's dtype is the file's pages, mapped,
  as transformers' loading keeps it: a model's files are replaced by new ones, not
  rewritten in place under a running worker.
- **transformers**: its own loading (mapped safetensors, renamings and conversions, GGUF).
- **runai-streamer** (`pip install 'preheat[fast-load]'`): many reads at once, which network
  volumes and object storage need, and what GPU hosts use it for; from the page cache on the
  CPU it is slower (0.53-0.79 s for 651 MB, `preheat bench start`).

`auto` takes the streamer on CUDA where it is installed, else transformers there; on the CPU
it reads by name, and a checkpoint that is not the model's own tensors as they are (or a
pinned revision) goes to transformers' loading instead. An explicit choice is honoured or
refused, never swapped for another. Every loader gives the same model: same classes, config
and generation_config.json, logits compared exactly (tests/workers/engine/test_weights.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from preheat.core.errors import ModelLoadError
from preheat.workers.engine.device import Placement

log = logging.getLogger(__name__)

LOADERS = ("auto", "transformers", "safetensors", "runai-streamer")
# The architectures read by name: each one's read is compared with transformers' loading in
# the tests, float32 and bfloat16 (tests/workers/engine/test_weights.py). Another one's
# constructor may leave a buffer for transformers' initialisation to fill, which a read by
# name would leave empty.
AS_NAMED = frozenset(
    {
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "GPT2LMHeadModel",
    }
)
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
    if preference == "auto" and placement.device.type == "cuda":
        return "runai-streamer" if streamer_installed() else "transformers"
    return "safetensors" if preference == "auto" else preference


# The model's own modules, as its code defines them: transformers 5.x swaps layers for Hub
# kernels by default where the `kernels` package is installed (seen on a CUDA host: a load
# that fetched from the Hub, which no worker reaches). preheat's steps replace the attention
# and the linear layers themselves, and nothing is fetched at run time.
_AS_IS = {"use_kernels": False}


class NotAsNamed(ModelLoadError):
    """The checkpoint is not the model's own tensors as they are: transformers' loading reads it."""


def load_weights(path: str, placement: Placement, preference: str, onto: dict, pinned: dict) -> tuple[object, str]:
    """The model at `path` with its weights in `placement.dtype` (moved to the device by the
    caller), and the loader that read it. `preference`: PREHEAT_WEIGHT_LOADER, or the loader
    that read the model before (a wake reads it the same way)."""
    from transformers import AutoModelForCausalLM

    loader = pick_loader(preference, placement, path)
    if loader == "safetensors":
        try:
            return _read_as_named(path, placement, pinned), loader
        except NotAsNamed as exc:
            if preference != "auto":
                raise
            log.info("%s: read by transformers' loading", exc)
            loader = "transformers"
    if loader == "runai-streamer":
        return _streamed(path, placement, pinned), loader
    source = gguf_source(path) if is_gguf(path) else {"pretrained_model_name_or_path": path, **pinned}
    return AutoModelForCausalLM.from_pretrained(**source, **_AS_IS, dtype=placement.dtype, **onto), loader


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
    model.config.name_or_path = path  # as transformers' loading records it
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def _read_as_named(path: str, placement: Placement, pinned: dict):
    """The `safetensors` loader (the module's docstring): the model built from its config
    without initialising its parameters, then each filled by name; `NotAsNamed` where the
    checkpoint is not what that can read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, initialization
    from transformers.modeling_utils import local_torch_dtype

    if pinned:
        raise NotAsNamed(f"revision {pinned['revision']!r}: a read by name takes the folder's files as they are")
    config = AutoConfig.from_pretrained(path)
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is None or model_class.__name__ not in AS_NAMED:
        name = model_class.__name__ if model_class is not None else type(config).__name__
        raise NotAsNamed(f"{name} is not an architecture read by name (those are: {', '.join(sorted(AS_NAMED))})")
    if getattr(config, "quantization_config", None):
        raise NotAsNamed(f"{path} is quantized: transformers' loading reads it")
    config.dtype = placement.dtype  # as transformers' loading records it
    with local_torch_dtype(placement.dtype, model_class.__name__), initialization.no_init_weights():
        model = model_class(config)
    model.tie_weights()  # a tied weight is one parameter under both names, filled by its first
    persistent = set(model.state_dict()) - {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if persistent:
        raise NotAsNamed(f"{model_class.__name__} keeps buffers in its checkpoint ({sorted(persistent)[0]}, …)")
    parameters = unique_parameters(model)
    shapes = {key: (parameter.shape, parameter.dtype) for key, (_, parameter) in parameters.items()}
    with torch.no_grad():
        unused = read_by_name(path, parameters, shapes, NotAsNamed)
    if unused:
        raise NotAsNamed(f"{path} holds tensors that are not {model_class.__name__}'s own ({unused[0]}, …)")
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def unique_parameters(model) -> dict[int, tuple[list[str], object]]:
    """Each parameter once (tied weights are one parameter under several names), with its
    names in the model's order: the first is the one transformers ties the others to."""
    found: dict[int, tuple[list[str], object]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        found.setdefault(id(parameter), ([], parameter))[0].append(name)
    return found


def read_by_name(path: str, parameters: dict, shapes: dict, missing_error: type[ModelLoadError]) -> list[str]:
    """Fill each of `parameters` (`unique_parameters`) with the tensor of its first name in
    the folder's safetensors files, as `shapes` gives its shape and dtype. A tensor under
    another name of a tied parameter is ignored, as transformers ties it; the names that are
    no parameter's are returned. A parameter with no tensor, or a tensor of another shape,
    raises `missing_error`."""
    from safetensors import safe_open

    first = {names[0]: key for key, (names, _) in parameters.items()}
    aliases = {name for names, _ in parameters.values() for name in names[1:]}
    filled, unused = set(), []
    files = sorted(Path(path).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is no mapping
                key = first.get(name)
                if key is None:
                    if name not in aliases:
                        unused.append(name)
                    continue
                shape, dtype = shapes[key]
                tensor = tensors.get_tensor(name)
                if tensor.shape != shape:
                    raise missing_error(
                        f"{file.name}: {name} has shape {tuple(tensor.shape)}, the model {tuple(shape)}"
                    )
                parameter = parameters[key][1]
                if tensor.dtype == dtype:  # the file's pages, mapped, as transformers' loading keeps them
                    parameter.data = tensor
                elif parameter.shape == shape and parameter.dtype == dtype:
                    parameter.data.copy_(tensor)  # into the storage the model built, converted once
                else:
                    parameter.data = tensor.to(dtype)
                filled.add(key)
    missing = [names[0] for key, (names, _) in parameters.items() if key not in filled]
    if missing:
        where = f"{path}'s safetensors files" if files else f"{path} (it has no .safetensors files)"
        raise missing_error(f"{len(missing)} weight(s) not found by name in {where} (first: {missing[0]})")
    return unused
