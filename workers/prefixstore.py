"""Pre-filled prefixes kept on disk, so a restarted worker restores them instead of
computing them again (vLLM's filesystem tier, LMCache's local disk backend).

One safetensors file per prefix (never pickle: a file on a shared volume is untrusted
input), written under a temporary name and renamed, so a reader sees a whole file or none.
A file is used only when its key matches exactly: the model files' identity (size and
mtime of every weight and config file, and the revision), dtype, device kind, the
attention layout (layer types, windows, KV heads, head size) and the prefix's own ids. A
truncated, corrupt or mismatched file costs one log line; it is removed and the prefix is
computed instead. The store has its own byte budget, least recently used first (a restore
touches the file).

Like the KV cache manager, it keeps no model: it stores and rebuilds the tensors of a
transformers cache (``DynamicLayer`` and ``DynamicSlidingWindowLayer``; other layer types
are not stored) and the logits after the last id.
"""

from __future__ import annotations

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

from workers.prefix import Prefix
from workers.resident import ResidentModel

log = logging.getLogger(__name__)

FORMAT = "preheat-prefix/1"
SUFFIX = ".safetensors"


def model_identity(resident: ResidentModel) -> dict[str, str]:
    """What must match for a stored prefix to be this model's: files, dtype, device, layout."""
    folder = Path(resident.path)
    kept = (".safetensors", ".bin", ".json")
    files = sorted(p for p in folder.iterdir() if p.suffix in kept) if folder.is_dir() else []
    stamp = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
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
        "files": hashlib.sha256("\n".join([resident.path, *stamp]).encode()).hexdigest(),
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
        self._identities: dict[str, dict[str, str]] = {}
        # Writes leave the request path: a prefix's tensors are never written once cached.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-store")
        self._pending: list[Future] = []

    def save_later(self, resident: ResidentModel, ids: np.ndarray, prefix: Prefix) -> None:
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._writer.submit(self.save, resident, np.array(ids), prefix))

    def flush(self) -> None:
        """Wait for the writes under way (a worker's shutdown, tests)."""
        for future in list(self._pending):
            future.result()

    # Keys ---------------------------------------------------------------------------

    def _identity(self, resident: ResidentModel) -> dict[str, str]:
        # Per process: the model files do not change under a resident model.
        if resident.name not in self._identities:
            self._identities[resident.name] = model_identity(resident)
        return self._identities[resident.name]

    def path_for(self, resident: ResidentModel, ids: np.ndarray) -> Path:
        identity = self._identity(resident)
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
        digest.update(memoryview(np.ascontiguousarray(ids, dtype=np.int64)))
        return self.folder / f"{resident.name}-{digest.hexdigest()[:40]}{SUFFIX}"

    # Writing ------------------------------------------------------------------------

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
        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            save_file(tensors, str(temporary), metadata=metadata)
            with open(temporary, "rb") as written:
                os.fsync(written.fileno())
            os.replace(temporary, path)
        except OSError as exc:
            log.warning("prefix of %s not stored in %s: %s", resident.name, self.folder, exc)
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
        from safetensors import safe_open

        device = resident.placement.device
        with safe_open(str(path), framework="pt", device="cpu") as stored:
            metadata = stored.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT}")
            for name, value in self._identity(resident).items():
                if metadata.get(f"identity.{name}") != value:
                    raise ValueError(f"stored for another {name}")
            if not np.array_equal(stored.get_tensor("ids").numpy(), ids):
                raise ValueError("stored for other token ids")
            layers = json.loads(metadata["layers"])
            tensors = {name: stored.get_tensor(name).to(device, non_blocking=True) for name in stored.keys()}  # noqa: SIM118 (no __iter__)
        prefix = Prefix(_cache_from(resident, layers, tensors), tensors["logits"])
        if prefix.cache.get_seq_length() != len(ids):
            raise ValueError(f"holds {prefix.cache.get_seq_length()} positions for {len(ids)} ids")
        return prefix

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob(f"*{SUFFIX}")) if self.folder.is_dir() else 0


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
        tensors[f"keys.{i}"] = layer.keys.contiguous().cpu()
        tensors[f"values.{i}"] = layer.values.contiguous().cpu()
    return tensors, layers


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
