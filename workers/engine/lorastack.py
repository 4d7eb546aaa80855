"""LoRA adapters stacked for a compiled step (preheat.workers.engine.compiled): the rows of
one step that use different adapters, and the base's, in one graph, as the eager hooks of
preheat.workers.engine.lora do in one eager pass.

A graph cannot take a hook per adapter, nor a tensor per module and adapter: the adapters
of a step are *stacked*, per kind of target module (q_proj of every layer, …), into one A
[layers, R, in] and one B [layers, R, out] (B transposed: each adapter's rows of both in
order), R their ranks concatenated, each adapter's scaling in its rows of B; a [tokens, 2] table
(`step_columns`) holds each token's own adapter's columns (first, rank). The graph's linear
layer `(layer, kind)` adds, per token, `(A[layer][c] @ x) @ B[layer][c]` over those columns
only: PEFT's `(x @ A.T) @ B.T * scaling` (the op `preheat::lora_add`, preheat's own kernel:
preheat.workers.engine.cpukernels). R is a symbolic size of the graph, so one compile serves
any set of adapters. Stacks are in the model's dtype where the kernel reads them (bf16: the
step reads every present adapter's rows, and in float32 16 adapters weigh more than the model;
B times the scaling is rounded once, where PEFT rounds B's product and then its scaled value),
float32 elsewhere.
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass

import torch

from preheat.workers.engine import cpukernels
from preheat.workers.engine.lora import LoraWeights

# A decoder layer's module: "model.layers.3.self_attn.q_proj" is kind
# "model.layers.*.self_attn.q_proj", layer 3.
_LAYERED = re.compile(r"^(.*?)\.(\d+)\.(.+)$")


def kind_and_layer(path: str) -> tuple[str, int] | None:
    """A module's kind (its path, the layer's number a star) and layer; None outside the layers."""
    found = _LAYERED.match(path)
    return (f"{found[1]}.*.{found[3]}", int(found[2])) if found else None


@dataclass(frozen=True)
class Targets:
    """What a compiled step can apply an adapter to: every linear layer of the decoder layers,
    per kind, as (layers, out_features, in_features); and the dtype its stacks are kept in."""

    kinds: dict[str, tuple[int, int, int]]
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, model) -> Targets:
        kinds: dict[str, tuple[int, int, int]] = {}
        for path, module in model.named_modules():
            # nn.Linear, or the compiled steps' stand-in for it (same weight, same features)
            linear = hasattr(module, "in_features") and isinstance(getattr(module, "weight", None), torch.Tensor)
            if linear and (found := kind_and_layer(path)) is not None:
                kind, layer = found
                layers = max(kinds.get(kind, (0,))[0], layer + 1)
                kinds[kind] = (layers, module.out_features, module.in_features)
        # bf16 stacks where the model is bf16 and preheat's kernel reads them: a step reads
        # every present adapter's rows once, and at 16 adapters of rank 16 on the real model
        # that is 312 MB in float32, more than the model's own weights.
        weight = next(model.parameters())
        bf16 = weight.dtype == torch.bfloat16 and weight.is_cpu and cpukernels.available()
        return cls(kinds, torch.bfloat16 if bf16 else torch.float32)

    def covers(self, adapter: LoraWeights) -> bool:
        return all((found := kind_and_layer(m)) is not None and found[0] in self.kinds for m in adapter.layers)


@dataclass(eq=False)
class Stacked:
    """The adapters of a step, stacked for a compiled graph (a graph input each, whatever the
    number of adapters): per kind, A [layers, R, in] and B [layers, R, out], in the targets'
    dtype, R their ranks concatenated in name order, zeros where an adapter leaves a module
    alone; B's rows scaled by their adapter's scaling."""

    adapters: tuple[LoraWeights, ...]
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]

    @property
    def rank(self) -> int:
        return sum(adapter.rank for adapter in self.adapters)

    @staticmethod
    def width_of(rank: int) -> int:
        """R for adapters of `rank` in all: at least 2 (a zero column beside a lone rank-1
        adapter), since a symbolic size of 0 or 1 would be a graph of its own."""
        return max(rank, 2)

    @property
    def width(self) -> int:
        return self.width_of(self.rank)

    @classmethod
    @torch.inference_mode()  # inference tensors, as every input of a compiled step
    def of(cls, adapters: tuple[LoraWeights, ...], targets: Targets, device) -> Stacked:
        width = cls.width_of(sum(adapter.rank for adapter in adapters))
        kinds = targets.kinds.items()
        a = {k: torch.zeros((n, width, i), dtype=targets.dtype, device=device) for k, (n, _, i) in kinds}
        b = {k: torch.zeros((n, width, o), dtype=targets.dtype, device=device) for k, (n, o, _) in kinds}
        offset = 0
        for adapter in adapters:
            for module, (down, up) in adapter.layers.items():
                kind, layer = kind_and_layer(module)
                a[kind][layer, offset : offset + adapter.rank] = down
                b[kind][layer, offset : offset + adapter.rank] = up.t().float() * adapter.scaling  # one rounding
            offset += adapter.rank
        return cls(adapters, a, b)


class AdapterStack:
    """The stacks one model's compiled steps run with. A step takes the smallest kept stack
    that holds all its adapters (the others' columns unread); when none does, one is
    built of its adapters and those of the steps just before it (`RECENT_STEPS`), so a
    steady mix of tenants is stacked once, however its rows come and go, and an adapter
    that stopped coming leaves the next stack. Building one costs tens of milliseconds on
    the real model; `admit` builds an adapter's own ahead of its first step (a warmup's read)."""

    RECENT_STEPS = 32
    KEPT = 4

    def __init__(self, targets: Targets, device) -> None:
        self.targets, self._device = targets, device
        self._seen: dict[int, tuple[int, LoraWeights]] = {}  # id -> (the last step it ran in, it)
        self._stacks: list[Stacked] = []  # most recently used first
        self._steps = 0
        self._lock = threading.Lock()
        self._covered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter -> targets.covers

    def covers(self, adapter: LoraWeights) -> bool:
        """`targets.covers`, once per adapter: a step asks it of each of its adapters."""
        if (known := self._covered.get(adapter)) is None:
            known = self._covered[adapter] = self.targets.covers(adapter)
        return known

    def for_step(self, present: tuple[LoraWeights, ...]) -> Stacked:
        with self._lock:
            self._steps += 1
            for adapter in present:
                self._seen[id(adapter)] = (self._steps, adapter)
            wanted = {id(adapter) for adapter in present}
            holding = [s for s in self._stacks if wanted <= {id(a) for a in s.adapters}]
            if holding:
                chosen = min(holding, key=lambda s: s.rank)
            else:
                recent = [a for at, a in self._seen.values() if self._steps - at < self.RECENT_STEPS]
                chosen = Stacked.of(tuple(sorted(recent, key=lambda a: a.name)), self.targets, self._device)
            self._stacks = [chosen, *(s for s in self._stacks if s is not chosen)][: self.KEPT]
            self._seen = {key: seen for key, seen in self._seen.items() if self._steps - seen[0] < self.RECENT_STEPS}
            return chosen

    def admit(self, adapter: LoraWeights) -> None:
        """Its own stack built now, ahead of the first step that needs it (read ahead of its
        tenants): that step does not pay for it."""
        if self.covers(adapter):
            with self._lock:
                if not any(adapter in s.adapters for s in self._stacks):
                    made = Stacked.of((adapter,), self.targets, self._device)
                    self._stacks = [made, *self._stacks][: self.KEPT]


def step_columns(lengths: list[int], adapters: list[LoraWeights | None], stack: Stacked) -> torch.Tensor:
    """[tokens, 2] int64, for packed rows (row i's `lengths[i]` tokens): each token's own
    adapter's columns in `stack`, as (first, rank); (0, 0) for the base's tokens."""
    columns, offset = {}, 0
    for adapter in stack.adapters:
        columns[id(adapter)] = (offset, adapter.rank)
        offset += adapter.rank
    base = (0, 0)
    pairs = []
    for length, adapter in zip(lengths, adapters, strict=True):
        pairs += [base if adapter is None else columns[id(adapter)]] * length
    return torch.tensor(pairs, dtype=torch.int64)
