"""LoRA adapters on a resident model: read beside the base (never a reload of it), kept in a
few slots (LRU, pins with a cap, as prefixes are), and applied per row: the rows of a step
that use different adapters, and the base's, run in one forward pass, each token's delta
from its own adapter (S-LoRA's and Punica's batching, as one gather per adapter present).

An adapter is a PEFT LoRA folder: `adapter_config.json` and `adapter_model.safetensors`.
What comes from disk is proven before use: a plain LoRA (no DoRA, no bias, no
`modules_to_save`), its rank within the cap, every tensor a target module of this base with
the base's shapes, finite values. A bad adapter is one line (`AdapterError`); the model and
its other adapters serve on.

The delta is applied by forward hooks on the target modules for the length of one eager
pass (`applied`): a compiled step's graph never sees them (its adapter steps stack the
adapters instead: preheat.workers.engine.lorastack), and a base-only step runs as fast as
before. `delta = (x @ A.T) @ B.T * scaling`, PEFT's own order, so answers match
transformers + PEFT with that adapter on the same ids.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from preheat.core.errors import PreheatError

PEFT_PREFIX = "base_model.model."
MAX_RANK_DEFAULT = 64


class AdapterError(PreheatError):
    """An adapter that cannot be used here: missing, not a LoRA, for another base, too large, damaged."""


@dataclass(eq=False)
class LoraWeights:
    """One adapter, read and proven: per target module (its path in the base), A [r, in] and B [out, r]."""

    name: str
    model: str  # the base's catalog name
    path: str
    rank: int
    scaling: float
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    load_ms: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(a.untyped_storage().nbytes() + b.untyped_storage().nbytes() for a, b in self.layers.values())

    @property
    def namespace(self) -> str:
        """Its prefixes' cache namespace: a prefix never crosses adapters (nor the base)."""
        return namespace(self.model, self.name)


def namespace(model: str, adapter: str | None) -> str:
    return model if adapter is None else f"{model}+{adapter}"


def read_adapter(name: str, model_name: str, path: str | Path, model, *, max_rank: int) -> LoraWeights:
    """The adapter at `path`, proven against `model` (the resident base), on its device and
    dtype. AdapterError with one line saying what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    started = time.perf_counter()
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    where = f"adapter {name!r} ({folder})"
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"{where}: no adapter_config.json and adapter_model.safetensors there")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{where}: adapter_config.json is not JSON ({exc})") from None
    rank, alpha = _check_config(where, config, max_rank)
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{where}: adapter_model.safetensors cannot be read ({exc})") from None
    parameter = next(model.parameters())
    layers = _pair_layers(where, tensors, model, rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    layers = {
        module: (
            a.to(parameter.device, parameter.dtype).contiguous(),
            b.to(parameter.device, parameter.dtype).contiguous(),
        )
        for module, (a, b) in layers.items()
    }
    return LoraWeights(name, model_name, str(folder), rank, scaling, layers, (time.perf_counter() - started) * 1000)


def _check_config(where: str, config: dict, max_rank: int) -> tuple[int, float]:
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{where}: peft_type is {config.get('peft_type')!r}, only LORA is served")
    for unsupported, off in (("use_dora", False), ("bias", "none"), ("modules_to_save", None)):
        if config.get(unsupported, off) not in (off, [] if off is None else off):
            raise AdapterError(f"{where}: {unsupported}={config[unsupported]!r} is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{where}: rank_pattern / alpha_pattern are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{where}: rank {rank} is over the cap of {max_rank} (max_adapter_rank)")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    return rank, float(alpha)


def _pair_layers(where: str, tensors: dict, model, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, rest = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not module or rest not in ("A.weight", "B.weight"):
            raise AdapterError(f"{where}: {key} is not a LoRA weight")
        halves.setdefault(module, {})[rest[0]] = tensor
    if not halves:
        raise AdapterError(f"{where}: no LoRA weights in adapter_model.safetensors")
    layers = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: {module} has lora_{''.join(pair)} without its other half")
        try:
            target = model.get_submodule(module)
        except AttributeError:
            raise AdapterError(f"{where}: {module} is not a module of this base (another base model?)") from None
        weight = getattr(target, "weight", None)
        if weight is None or weight.dim() != 2:
            raise AdapterError(f"{where}: {module} is not a linear layer of this base")
        out_features, in_features = weight.shape
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise AdapterError(
                f"{where}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; this base needs "
                f"({rank}, {in_features}) and ({out_features}, {rank}) (another base model?)"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{where}: {module} holds values that are not finite (damaged?)")
        layers[module] = (a, b)
    return layers


# Resident slots --------------------------------------------------------------------------


@dataclass
class AdapterSlots:
    """The adapters of one model resident now: at most `capacity`, the least recently used
    evicted first, pinned ones (a template's, a warmup's) never, and at most `max_pinned`
    pinned so pins can never take every slot. Bookkeeping only: testable without a model."""

    capacity: int = 4
    max_pinned: int = 2
    loads: int = 0
    evictions: int = 0
    _resident: OrderedDict[str, LoraWeights] = field(default_factory=OrderedDict)
    _pinned: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.capacity < 1 or not 0 <= self.max_pinned <= self.capacity:
            raise ValueError(f"adapter slots: capacity {self.capacity}, max_pinned {self.max_pinned}")

    def get(self, name: str) -> LoraWeights | None:
        with self._lock:
            weights = self._resident.get(name)
            if weights is not None:
                self._resident.move_to_end(name)
            return weights

    def put(self, weights: LoraWeights, *, pin: bool = False) -> list[str]:
        """Resident now (most recently used); returns the names evicted to make room.
        AdapterError when every slot is pinned, or a pin would pass the cap."""
        with self._lock:
            if pin and weights.name not in self._pinned and len(self._pinned) >= self.max_pinned:
                raise AdapterError(f"adapter {weights.name!r}: {len(self._pinned)} adapters are pinned (the cap)")
            evicted = []
            while weights.name not in self._resident and len(self._resident) >= self.capacity:
                victim = next((name for name in self._resident if name not in self._pinned), None)
                if victim is None:
                    raise AdapterError(f"adapter {weights.name!r}: every one of {self.capacity} slots is pinned")
                del self._resident[victim]
                evicted.append(victim)
            self.evictions += len(evicted)
            if weights.name not in self._resident:
                self.loads += 1
            self._resident[weights.name] = weights
            self._resident.move_to_end(weights.name)
            if pin:
                self._pinned.add(weights.name)
            return evicted

    def pin(self, name: str) -> None:
        with self._lock:
            if name not in self._resident:
                raise AdapterError(f"adapter {name!r} is not resident")
            if name not in self._pinned and len(self._pinned) >= self.max_pinned:
                raise AdapterError(f"adapter {name!r}: {len(self._pinned)} adapters are pinned (the cap)")
            self._pinned.add(name)

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pinned.discard(name)

    def clear(self) -> list[LoraWeights]:
        """Every adapter let go, pins with them (the model went to sleep); returns them, to be
        read (and pinned) again on wake by whoever kept which were pinned."""
        with self._lock:
            gone = list(self._resident.values())
            self._resident.clear()
            self._pinned.clear()
            return gone

    @property
    def resident(self) -> list[str]:
        return list(self._resident)

    @property
    def pinned(self) -> set[str]:
        return set(self._pinned)

    def describe(self) -> dict:
        return {
            "resident": self.resident,
            "pinned": sorted(self._pinned),
            "capacity": self.capacity,
            "loads": self.loads,
            "evictions": self.evictions,
        }


# Applying them --------------------------------------------------------------------------


def token_rows(
    lengths: list[int], adapters: list[LoraWeights | None], device
) -> list[tuple[LoraWeights, torch.Tensor]]:
    """For a pass over packed rows (row i's `lengths[i]` tokens, one after another): each
    adapter present and the positions of its tokens. Rows of the base take none."""
    positions: dict[int, tuple[LoraWeights, list[int]]] = {}
    start = 0
    for length, adapter in zip(lengths, adapters, strict=True):
        if adapter is not None:
            positions.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + length))
        start += length
    # In name order, whatever the rows' order: the same adapters are the same concatenation.
    present = sorted(positions.values(), key=lambda pair: pair[0].name)
    return [(adapter, torch.tensor(where, device=device)) for adapter, where in present]


@contextlib.contextmanager
def applied(model, rows: list[tuple[LoraWeights, torch.Tensor]]):
    """For one forward pass: each target module adds, for the tokens of each adapter, that
    adapter's delta to its output. No rows: nothing is hooked.

    One adapter in the pass: its tokens gathered, `(x @ A.T) @ B.T * scaling` added back
    (PEFT's order). Several: their A and B concatenated along the rank (cached while the
    same adapters run together), one product for every token, each token's columns of the
    other adapters masked to zero, one product back: four operations a module whatever the
    number of adapters, where a loop over them would cost a Python round per adapter."""
    by_module: dict[str, list[tuple[LoraWeights, torch.Tensor]]] = {}
    for adapter, where in rows:
        for module in adapter.layers:
            by_module.setdefault(module, []).append((adapter, where))
    masks: dict[tuple, torch.Tensor] = {}  # one per set of adapters, shared by the modules
    handles = []
    try:
        for module, present in by_module.items():
            hook = _one(module, *present[0]) if len(present) == 1 else _several(module, present, masks)
            handles.append(model.get_submodule(module).register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _one(module: str, adapter: LoraWeights, where: torch.Tensor):
    a, b = adapter.layers[module]

    def hook(_module, args, output):
        x = args[0]
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), output.reshape(-1, output.shape[-1])
        delta = (flat_x.index_select(0, where) @ a.T) @ b.T * adapter.scaling
        flat_out.index_add_(0, where, delta.to(flat_out.dtype))
        return flat_out.reshape(output.shape)

    return hook


# A and B of the adapters that ran together lately, concatenated along the rank, per module.
# Each entry holds its adapters, so an id in its key is never reused while it is kept.
_CONCATENATED: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, tuple]] = OrderedDict()
_CONCATENATED_KEPT = 512
_CONCATENATED_LOCK = threading.Lock()


def _concatenated(module: str, adapters: tuple[LoraWeights, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    key = (module, tuple(id(adapter) for adapter in adapters))
    with _CONCATENATED_LOCK:
        if (kept := _CONCATENATED.get(key)) is not None:
            _CONCATENATED.move_to_end(key)
            return kept[0], kept[1]
    a = torch.cat([adapter.layers[module][0] for adapter in adapters], dim=0)  # [R, in]
    b = torch.cat([adapter.layers[module][1] for adapter in adapters], dim=1)  # [out, R]
    with _CONCATENATED_LOCK:
        _CONCATENATED[key] = (a, b, adapters)
        while len(_CONCATENATED) > _CONCATENATED_KEPT:
            _CONCATENATED.popitem(last=False)
    return a, b


def _mask(present: list[tuple[LoraWeights, torch.Tensor]], tokens: int, like: torch.Tensor) -> torch.Tensor:
    """[tokens, R]: each token's own adapter's columns hold its scaling, every other zero."""
    mask = torch.zeros(tokens, sum(adapter.rank for adapter, _ in present), dtype=like.dtype, device=like.device)
    offset = 0
    for adapter, where in present:
        mask[where, offset : offset + adapter.rank] = adapter.scaling
        offset += adapter.rank
    return mask


def _several(module: str, present: list[tuple[LoraWeights, torch.Tensor]], masks: dict):
    adapters = tuple(adapter for adapter, _ in present)
    a, b = _concatenated(module, adapters)
    key = tuple(id(adapter) for adapter in adapters)

    def hook(_module, args, output):
        x = args[0]
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), output.reshape(-1, output.shape[-1])
        if (mask := masks.get(key)) is None:
            mask = masks[key] = _mask(present, flat_x.shape[0], flat_x)
        flat_out.add_(((flat_x @ a.T) * mask) @ b.T)
        return flat_out.reshape(output.shape)

    return hook
