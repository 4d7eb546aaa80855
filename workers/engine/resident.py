"""Models kept resident in a worker process (LLMs in memory; the ORM rows are preheat.history.models).

A worker loads each catalog model once and keeps it for the life of the process; every
warmup and request after that reuses it. A model that fails to load is remembered as
unavailable with its error, so one broken model never takes the worker down.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from preheat.core.errors import ModelLoadError
from preheat.workers.engine import attention
from preheat.workers.engine.device import Placement, pick_placement
from preheat.workers.engine.openmp import team_released
from preheat.workers.engine.runner import ModelRunner, max_context
from preheat.workers.engine.weights import gguf_source, is_gguf, load_weights

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The chat template of a model that has none (and none set in the catalog): ChatML, as
# text, so it needs no special tokens and works with any tokenizer.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_CHAT_TEMPLATE_NAME = "preheat's default (ChatML)"


@dataclass
class ResidentModel:
    name: str
    path: str
    model: object  # transformers PreTrainedModel
    tokenizer: object  # transformers tokenizer
    placement: Placement
    load_ms: float
    # transformers 5.24 renamed the forward kwarg `past_key_values` to `cache`.
    cache_kwarg: str = "past_key_values"
    max_context: int = 0
    chat_template_source: str = "the model's own"
    weight_loader: str = "transformers"  # the one that read it (workers/engine/weights.py)
    runner: ModelRunner | None = None  # what runs it: every forward pass, compiled or eager

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Every end-of-sequence id: the tokenizer's and all of generation_config.json's."""
        ids = {self.tokenizer.eos_token_id}
        generation_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        return frozenset(i for i in ids if i is not None)

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        """What one position of its KV takes, every layer's keys and values, from its config:
        what a fleet plans pins by (preheat.fleet.placement). The cache counts exact bytes."""
        config = self.model.config
        config = getattr(config, "get_text_config", lambda: config)()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        itemsize = next(self.model.parameters()).element_size()
        return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize

    @functools.cached_property
    def content_digest(self) -> str:
        """The model's identity from what it computes with: its configuration and every byte
        of every weight and buffer (`digest_contents`). Computed at load."""
        return digest_contents(self.model)

    @functools.cached_property
    def vocab_size(self) -> int:
        """How many ids the model's logits score (padded rows included)."""
        return int(self.model.config.get_text_config().vocab_size)


@dataclass(frozen=True)
class ModelSource:
    """Where a catalog model is loaded from."""

    name: str
    path: str
    dtype: str = "auto"
    revision: str | None = None
    # The catalog's chat template for this model (it replaces the model's own), and where
    # it came from; None: the model's own, else DEFAULT_CHAT_TEMPLATE.
    chat_template: str | None = None
    chat_template_source: str | None = None


@dataclass
class ResidentModels:
    """The models resident in this process. Thread-safe: different models load in
    parallel, a second caller for the same model waits for the first load."""

    device_preference: str = "auto"
    weight_loader: str = "auto"  # PREHEAT_WEIGHT_LOADER (workers/weights.py)
    # PREHEAT_DTYPE (a worker's: auto; by hand, float32); a model's catalog dtype, when not auto, wins.
    dtype_preference: str = "float32"
    _models: dict[str, ResidentModel] = field(default_factory=dict)
    _errors: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loading: dict[str, threading.Lock] = field(default_factory=dict)
    _preloading: threading.Lock = field(default_factory=threading.Lock)
    _preloaded: bool = False

    def ensure(self, source: ModelSource) -> tuple[ResidentModel, float]:
        """Return the resident model and the milliseconds this call spent loading it (0 if resident)."""
        with self._lock:
            name_lock = self._loading.setdefault(source.name, threading.Lock())
        with name_lock:
            if source.name in self._models:
                return self._models[source.name], 0.0
            started = time.perf_counter()
            try:
                placement = pick_placement(self.device_preference, source.dtype, self.dtype_preference)
                with team_released():  # a loader's thread (a bench's main thread) lives on
                    resident = _load(source, placement, self.weight_loader)
            except Exception as exc:
                self._errors[source.name] = f"{type(exc).__name__}: {exc}"
                raise ModelLoadError(
                    f"model {source.name!r} failed to load from {source.path}: {self._errors[source.name]}"
                ) from exc
            resident.load_ms = (time.perf_counter() - started) * 1000
            self._models[source.name] = resident
            self._errors.pop(source.name, None)
            log.info(
                "model %s resident on %s after %.0f ms (weights read by %s)",
                source.name,
                resident.placement.describe(),
                resident.load_ms,
                resident.weight_loader,
            )
            return resident, resident.load_ms

    def preload(self, sources: list[ModelSource], max_parallel: int = 4) -> dict[str, str]:
        """Load every model at once (threads: loading is I/O and torch ops that release the
        GIL). A model that fails is left unavailable; the others load. Returns the failures."""
        if not sources:
            return {}
        with ThreadPoolExecutor(max_workers=min(max_parallel, len(sources)), thread_name_prefix="preload") as pool:
            futures = {source.name: pool.submit(self.ensure, source) for source in sources}
        failures = {}
        for name, future in futures.items():
            if future.exception() is not None:
                failures[name] = str(future.exception())
                log.error("%s; the worker serves the other models", future.exception())
        return failures

    def preload_once(self, sources: list[ModelSource], max_parallel: int = 4) -> None:
        """`preload`, once: a worker starts it early, as Celery builds its pool, and its
        start-up pre-fill asks again; a second call waits for the first. Later warmups load
        a model that failed themselves (`ensure`)."""
        with self._preloading:
            if not self._preloaded:
                self.preload(sources, max_parallel)
                self._preloaded = True

    def get(self, name: str) -> ResidentModel | None:
        return self._models.get(name)

    def drop(self, name: str) -> ResidentModel | None:
        """No longer resident (asleep at level 2): the next `ensure` loads it again."""
        with self._lock:
            return self._models.pop(name, None)

    @property
    def resident(self) -> dict[str, ResidentModel]:
        return dict(self._models)

    @property
    def unavailable(self) -> dict[str, str]:
        return dict(self._errors)


def digest_contents(model) -> str:
    """SHA-256 of the model's configuration (every value, `rope_theta` included, not the folder
    it was read from) and of every byte of every tensor of its state (name, shape, dtype, then
    the bytes): a weight changed anywhere changes it. Each distinct storage is hashed once
    (tied weights share one), the tensors in parallel (hashlib lets go of the GIL), the
    per-tensor digests combined in name order. Measured on 2 cores for SmolLM2-135M: 168 ms
    in float32, 92 ms in bfloat16, against 14 ms for the strided sample it replaced, which
    missed a changed row (docs/benchmarks.md)."""
    import hashlib
    import json

    import torch

    def bytes_digest(tensor) -> bytes:
        flat = tensor.detach().reshape(-1).contiguous().to("cpu")
        return hashlib.sha256(memoryview(flat.view(torch.uint8).numpy())).digest()

    def same(tensor) -> tuple:  # tied weights: one tensor under two names
        return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype

    state = sorted(model.state_dict().items())
    unique = {same(tensor): tensor for _, tensor in state}
    with torch.inference_mode(), ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        by_tensor = dict(zip(unique, pool.map(bytes_digest, unique.values()), strict=True))
    # Where the files lie is not what they hold: replicas that mount one model at different
    # paths share a prefix store and a compile cache.
    config = json.loads(model.config.to_json_string(use_diff=False))
    config.pop("_name_or_path", None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name, tensor in state:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(by_tensor[same(tensor)])
    return digest.hexdigest()


# transformers resolves its top-level names lazily, and two threads doing so at once can
# fail ("cannot import name 'AutoModelForCausalLM'"): a catalog of several models loads in
# parallel (preload), so the first resolution is done by one thread at a time.
_IMPORT_LOCK = threading.Lock()
# transformers builds a model under process-wide switches (accelerate's empty-weights patch of
# nn.Module, its no-init flag): two loads at once in one process can each see the other's,
# and one comes back with its tied output head untied and random (seen: "lm_head.weight
# MISSING", answers of noise) or on the meta device. So the weights are read one model at a
# time; what loads at the same time as preheat (a reference in a test) takes this lock too.
LOADING = threading.Lock()


def _load(source: ModelSource, placement: Placement, preference: str) -> ResidentModel:
    with _IMPORT_LOCK:
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401 (resolved here, once)
        from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    pinned = {"revision": source.revision} if source.revision else {}
    if is_gguf(source.path):  # its tokenizer and chat template are in the file's metadata
        tokenizer = AutoTokenizer.from_pretrained(**gguf_source(source.path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(source.path, **pinned)
    template_source = source.chat_template_source or "the model's own"
    if source.chat_template is not None:
        tokenizer.chat_template = source.chat_template
    elif not tokenizer.chat_template:
        tokenizer.chat_template, template_source = DEFAULT_CHAT_TEMPLATE, DEFAULT_CHAT_TEMPLATE_NAME
    with LOADING:
        model, loader = load_weights(source.path, placement, preference, _onto(placement), pinned)
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(attention.register())
    model.to(placement.device).eval()
    model.requires_grad_(False)  # inference only: no autograd bookkeeping on any forward
    forward_params = inspect.signature(model.forward).parameters
    cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
    resident = ResidentModel(
        name=source.name,
        path=source.path,
        model=model,
        tokenizer=tokenizer,
        placement=placement,
        load_ms=0.0,
        cache_kwarg=cache_kwarg,
        max_context=max_context(model.config),
        chat_template_source=template_source,
        weight_loader=loader,
        runner=ModelRunner(source.name, model, placement, cache_kwarg),
    )
    resident.content_digest  # noqa: B018 - at load, off the path of the first pre-fill and request
    return resident


def _onto(placement: Placement) -> dict:
    """Weights straight onto a GPU (never held twice, on the host then copied), which
    transformers does through accelerate (the `gpu` extra); else loaded, then moved."""
    import importlib.util

    if placement.device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
        return {"device_map": str(placement.device)}
    return {}


def encode(resident: ResidentModel, text: str, *, with_bos: bool) -> torch.Tensor:
    """Token ids of `text`, shape [1, n], on the CPU: ids are hashed and compared there, and
    the runner moves what it feeds to the model's device."""
    return resident.tokenizer(text, add_special_tokens=with_bos, return_tensors="pt")["input_ids"]


class ContextLengthError(ValueError):
    """A prompt and the tokens it asks for do not fit the model's context."""


def check_context(resident: ResidentModel, num_tokens: int, what: str, new_tokens: int = 1) -> None:
    """A prompt plus the tokens it will generate must fit the model's context."""
    if resident.max_context and num_tokens + new_tokens > resident.max_context:
        raise ContextLengthError(
            f"{what} is {num_tokens} tokens (+{new_tokens} to generate); model {resident.name!r} has a context "
            f"of {resident.max_context}"
        )
