"""Pre-filled prefixes kept on disk, so a restarted worker restores them instead of
computing them again (vLLM's filesystem tier, LMCache's local disk backend).

One safetensors file per prefix (never pickle: a file on a shared volume is untrusted
input), written under a temporary name and renamed, so a reader sees a whole file or none.
What comes back from disk is proven before it is used:

- its key matches exactly: the model's identity from its contents (its configuration and
  a sample of every weight, digested at load: a new checkpoint or a changed `rope_theta`
  under the same file sizes and times is another model), the revision, dtype, device kind,
  the attention layout (layer types, windows, KV heads, head size) and the prefix's own ids;
- every tensor (keys and values of each layer, the logits, the ids) has the SHA-256 it was
  written with: a flipped bit, bytes overwritten, another model's tensors put in its place;
- every tensor has the shape and dtype the model's layout gives for that many ids, checked
  before any cache is built, and holds only finite numbers.

A file that fails any of these costs one log line; it is removed and the prefix is computed
instead. The store has its own byte budget, least recently used first (a restore touches
the file).

Like the KV cache manager, it keeps no model: it stores and rebuilds the tensors of a
transformers cache (``DynamicLayer`` and ``DynamicSlidingWindowLayer``; other layer types
are not stored) and the logits after the last id.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from preheat.workers.engine.kvtensors import Prefix
from preheat.workers.engine.openmp import team_released
from preheat.workers.engine.resident import ResidentModel

log = logging.getLogger(__name__)

FORMAT = "preheat-prefix/2"  # 2: a SHA-256 per tensor, the model identified by its contents
SUFFIX = ".safetensors"


def model_identity(resident: ResidentModel) -> dict[str, str]:
    """What must match for a stored prefix to be this model's: contents, dtype, device, layout."""
    config = resident.model.config.get_text_config()
    layout = {
        "layer_types": getattr(config, "layer_types", None),
        "sliding_window": getattr(config, "sliding_window", None),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "head_dim": getattr(config, "head_dim", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "attention": getattr(resident.model.config, "_attn_implementation", None),
    }
    return {
        "contents": resident.content_digest,
        "revision": getattr(resident.model.config, "_commit_hash", None) or "",
        "dtype": str(resident.placement.dtype),
        "device": resident.placement.device.type,
        "layout": hashlib.sha256(json.dumps(layout, sort_keys=True, default=str).encode()).hexdigest(),
    }


@dataclass(frozen=True)
class Restored:
    prefix: Prefix
    ms: float


class PrefixStore:
    """A folder of stored prefixes with a byte budget. Thread-safe."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder, self.max_bytes = Path(folder), max_bytes
        self._lock = threading.Lock()
        self._identities: dict[tuple[str, str], dict[str, str]] = {}
        # Writes leave the request path: a prefix's tensors are never written once cached.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-store")
        self._pending: list[Future] = []

    def save_later(self, resident: ResidentModel, ids: np.ndarray, prefix: Prefix) -> None:
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._writer.submit(self.save, resident, np.array(ids), prefix))

    def flush(self) -> None:
        """Wait for the writes under way (a worker's shutdown, a sleep, tests). A write that
        failed was logged where it failed; nothing here raises: a shutdown goes on."""
        for future in list(self._pending):
            future.exception()

    # Keys ---------------------------------------------------------------------------

    def _identity(self, resident: ResidentModel) -> dict[str, str]:
        # Per loaded model (its digest is taken once, at load): a level-2 wake or a reload of
        # changed files is a new model under the same name, never the old one's prefixes.
        key = (resident.name, resident.content_digest)
        if key not in self._identities:
            self._identities[key] = model_identity(resident)
        return self._identities[key]

    def path_for(self, resident: ResidentModel, ids: np.ndarray) -> Path:
        identity = self._identity(resident)
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
        digest.update(memoryview(np.ascontiguousarray(ids, dtype=np.int64)))
        return self.folder / f"{resident.name}-{digest.hexdigest()[:40]}{SUFFIX}"

    # Writing ------------------------------------------------------------------------

    def discard(self, resident: ResidentModel, ids: np.ndarray) -> None:
        """The stored prefix of `ids` removed (it was proven wrong): never restored again."""
        with contextlib.suppress(OSError):
            self.path_for(resident, ids).unlink(missing_ok=True)

    @team_released()  # on the store's writer thread, which lives on
    def save(self, resident: ResidentModel, ids: np.ndarray, prefix: Prefix) -> Path | None:
        """Store a computed prefix (best effort: a full disk or an unstorable layer type is
        logged, never raised). Returns the file, or None."""
        from safetensors.torch import save_file

        tensors, layers = _tensors_of(prefix)
        if tensors is None:
            log.info("prefix of %s not stored: its cache has layers the store does not keep", resident.name)
            return None
        path = self.path_for(resident, ids)
        metadata = {
            "format": FORMAT,
            "model": resident.name,
            "layers": json.dumps(layers),
            **{f"identity.{k}": v for k, v in self._identity(resident).items()},
        }
        tensors["ids"] = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        metadata.update({f"sha256.{name}": tensor_digest(tensor) for name, tensor in tensors.items()})
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(temporary), metadata=metadata)
            with open(temporary, "rb") as written:
                os.fsync(written.fileno())
            os.replace(temporary, path)
        except Exception as exc:  # a full disk (safetensors' own error), a folder that is a file now
            log.warning("prefix of %s not stored in %s: %s", resident.name, self.folder, str(exc).splitlines()[0])
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            return None
        self._within_budget(keep=path)
        return path

    def _within_budget(self, keep: Path) -> None:
        """Least recently used files go first until the store fits its byte budget."""
        with self._lock:
            files = [(p.stat().st_mtime_ns, p.stat().st_size, p) for p in self.folder.glob(f"*{SUFFIX}")]
            total = sum(size for _, size, _ in files)
            for _, size, path in sorted(files):
                if total <= self.max_bytes:
                    break
                if path != keep:
                    path.unlink(missing_ok=True)
                    total -= size
            if total > self.max_bytes:  # the new file alone is over the budget
                keep.unlink(missing_ok=True)
                log.warning("prefix file %s is larger than PREHEAT_PREFIX_STORE_MAX_BYTES: not kept", keep.name)

    # Reading ------------------------------------------------------------------------

    def restore(self, resident: ResidentModel, ids: np.ndarray) -> Restored | None:
        """The stored prefix of exactly these ids for this model, on its device; None when
        there is none. A file that cannot be used is removed, with one log line."""
        import time

        path = self.path_for(resident, ids)
        if not path.is_file():
            return None
        started = time.perf_counter()
        try:
            prefix = self._read(resident, ids, path)
        except Exception as exc:  # any way a file can be wrong: it is not used
            log.warning(
                "stored prefix %s is unusable (%s: %s): removed; computing it", path.name, type(exc).__name__, exc
            )
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used
        return Restored(prefix, (time.perf_counter() - started) * 1000)

    def _read(self, resident: ResidentModel, ids: np.ndarray, path: Path) -> Prefix:
        """The file's prefix, proven (see the module doc) before anything is built from it."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as stored:
            metadata = stored.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT}")
            for name, value in self._identity(resident).items():
                if metadata.get(f"identity.{name}") != value:
                    raise ValueError(f"stored for another {name}")
            tensors = {name: stored.get_tensor(name) for name in stored.keys()}  # noqa: SIM118 (no __iter__)
        for name, tensor in tensors.items():
            if metadata.get(f"sha256.{name}") != tensor_digest(tensor):
                raise ValueError(f"{name} is not what was written (its SHA-256 differs)")
        if not np.array_equal(tensors["ids"].numpy(), ids):
            raise ValueError("stored for other token ids")
        layers = json.loads(metadata["layers"])
        _check_shapes(resident, layers, tensors, len(ids))
        device = resident.placement.device
        on_device = {name: tensor.to(device, non_blocking=True) for name, tensor in tensors.items()}
        return Prefix(_cache_from(resident, layers, on_device), on_device["logits"])

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob(f"*{SUFFIX}")) if self.folder.is_dir() else 0


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a CPU tensor's bytes (1.3 GB/s here: 6 ms for the 8 MiB of a 2,058-token
    prefix of the tiny model, against 113 ms to compute it)."""
    return hashlib.sha256(memoryview(tensor.contiguous().view(torch.uint8).numpy())).hexdigest()


def _check_shapes(resident: ResidentModel, layers: list[dict], tensors: dict, num_ids: int) -> None:
    """Every tensor as the model's layout has it for `num_ids` ids: [1, KV heads, positions,
    head size] per layer (a sliding window holds its last window - 1 positions), the
    model's dtype, the logits one score per vocabulary id, every number finite."""
    config = resident.model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = resident.placement.dtype
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"{len(layers)} layers stored, the model has {config.num_hidden_layers}")
    for i, layer in enumerate(layers):
        positions = min(num_ids, layer["window"] - 1) if layer["kind"] == "sliding" else num_ids
        for name in (f"keys.{i}", f"values.{i}"):
            tensor = tensors[name]
            if tuple(tensor.shape) != (1, heads, positions, head_dim) or tensor.dtype != dtype:
                raise ValueError(
                    f"{name} is {tuple(tensor.shape)} {tensor.dtype}; the model has "
                    f"{(1, heads, positions, head_dim)} {dtype} for {num_ids} ids"
                )
    if tuple(tensors["logits"].shape) != (resident.vocab_size,):
        raise ValueError(f"logits are {tuple(tensors['logits'].shape)}; the model scores {resident.vocab_size} ids")
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"{name} holds numbers that are not finite")


def _tensors_of(prefix: Prefix) -> tuple[dict | None, list]:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    tensors, layers = {"logits": prefix.logits.detach().contiguous().cpu()}, []
    for i, layer in enumerate(prefix.cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            layers.append({"kind": "sliding", "window": layer.sliding_window, "seen": layer.cumulative_length})
        elif type(layer) is DynamicLayer:
            layers.append({"kind": "full"})
        else:
            return None, []
        tensors[f"keys.{i}"] = _own(layer.keys)
        tensors[f"values.{i}"] = _own(layer.values)
    return tensors, layers


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with a storage of its own: safetensors refuses tensors that share one
    (an entry's tensors are views into one slab, preheat.workers.engine.kvtensors.settle)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.contiguous()


def _cache_from(resident: ResidentModel, layers: list[dict], tensors: dict):
    """A transformers DynamicCache for the model, its layers holding the stored tensors."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache(config=resident.model.config)
    if len(cache.layers) != len(layers):
        raise ValueError(f"{len(layers)} layers stored, the model has {len(cache.layers)}")
    for i, (layer, stored) in enumerate(zip(cache.layers, layers, strict=True)):
        sliding = type(layer) is DynamicSlidingWindowLayer
        if sliding != (stored["kind"] == "sliding") or (sliding and layer.sliding_window != stored["window"]):
            raise ValueError(f"layer {i} is {stored['kind']} in the file and not in the model")
        keys, values = tensors[f"keys.{i}"], tensors[f"values.{i}"]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if sliding:
            layer.cumulative_length = int(stored["seen"])
    return cache
