"""preheat's linear layers in a compiled step (preheat.workers.engine.compiled): every nn.Linear
of the model, the output head too, made a `_CompiledLinear`, and the oneDNN ops they call.

A one-token step reads every weight once for one row: its
linear layers are written as a reduction (`(x * w).sum(-1)`), which inductor turns into loops
that stream float32 weights at memory speed (torch's GEMV for one row runs at a third of it
here: 8 GB/s against 24-29); bfloat16 weights, where the CPU multiplies bf16 pairs itself,
go through preheat's own kernel instead (preheat.workers.engine.cpukernels: twice the loops'
speed). A step of many rows uses oneDNN with the weights pre-packed for
it (`preheat::packed_linear`, an opaque op: a packed tensor cannot be a graph input). The
packed copies cost a second copy of the linear weights in memory, released with the graphs
(a sleep). Packing is speed, not warmth: a layer not packed yet runs the same product on its
weight as transformers does, and the scheduler packs one layer at a time while no request
waits or runs (`CompiledSteps.pack_next`), so a start or a wake does not wait for it (0.17 s
of an Intel host's start in bfloat16, 0.65 s of a Zen 3's in float32). On CUDA both are cuBLAS.

A step's LoRA adapters are added inside the same op (`STEP_ADAPTERS`, set by the step that
runs now).
"""

from __future__ import annotations

import zlib

import torch

from preheat.workers.engine import cpukernels
from preheat.workers.engine.lorastack import Stacked, kind_and_layer

_LAYERS: dict[int, _CompiledLinear] = {}  # weight id -> its layer, which holds the packed copy once made


def packed_linear(x: torch.Tensor, weight_id: int, out_features: int) -> torch.Tensor:
    """A linear layer through oneDNN with its weight packed ahead (`_CompiledLinear.pack`);
    before that, on the weight itself."""
    layer = _LAYERS[weight_id]
    if layer.packed is None:
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


def packed_linear_lora(
    x: torch.Tensor, weight_id: int, out_features: int, a: torch.Tensor, b: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """`packed_linear` and the step's adapters on its output in one op: each token's own
    adapter's delta added in place (cpukernels.lora_add), straight after the product."""
    y = packed_linear(x, weight_id, out_features)
    return cpukernels.lora_add(x, y, a, b, columns, out=y)


# torch.library's lower-level API, not `custom_op` (whose wrapper costs 7 us a call, 211 calls
# a step). On a 2-core VM that wrapper, between two ops that both use the two threads, is
# longer than the OpenMP team spins (GOMP_SPINCOUNT): the other thread sleeps, and the next
# op waits 35-40 us for its wake-up. For the same reason a step's adapters are added inside
# the linear layer's own op, not by an op of their own.
_LIBRARY = torch.library.Library("preheat", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, int weight_id, int out_features) -> Tensor")
_LIBRARY.impl("packed_linear", packed_linear, "CPU")
_LIBRARY.define(
    "packed_linear_lora(Tensor x, int weight_id, int out_features, Tensor a, Tensor b, Tensor columns) -> Tensor"
)
_LIBRARY.impl("packed_linear_lora", packed_linear_lora, "CPU")


@torch.library.register_fake("preheat::packed_linear")
def _(x, weight_id, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("preheat::packed_linear_lora")
def _(x, weight_id, out_features, a, b, columns):
    return x.new_empty((*x.shape[:-1], out_features))


class _StepAdapters:
    """The LoRA adapters of the step running now, read by the graph as inputs (stacked:
    preheat.workers.engine.lorastack). `on` is a constant of a graph: a step with adapters and
    one without run different graphs, and the base's graph has no trace of LoRA."""

    def __init__(self) -> None:
        self.on = False
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.columns: torch.Tensor | None = None  # [tokens, 2]: each token's (first column, rank)

    def set(self, stack: Stacked, columns: torch.Tensor) -> None:
        self.on, self.a, self.b, self.columns = True, stack.a, stack.b, columns

    def mark_dynamic(self, tokens: bool) -> None:
        """Before a graph is compiled on these: the rank symbolic (one graph for any set of
        adapters), and the number of tokens where the graph's is."""
        for kind in self.a:
            torch._dynamo.maybe_mark_dynamic(self.a[kind], 1)
            torch._dynamo.maybe_mark_dynamic(self.b[kind], 1)
        if tokens:
            torch._dynamo.maybe_mark_dynamic(self.columns, 0)

    def clear(self) -> None:
        self.on, self.a, self.b, self.columns = False, {}, {}, None

    def __reduce__(self):
        # A saved graph keeps the globals it reads: pickled by value, a loaded graph would read
        # the adapters of the step it was compiled on forever. By name, it reads this process's.
        return (_step_adapters, ())


STEP_ADAPTERS = _StepAdapters()


def _step_adapters() -> _StepAdapters:
    return STEP_ADAPTERS


class _CompiledLinear(torch.nn.Module):
    """nn.Linear's forward, eager as transformers runs it; compiled, the shape's fastest way."""

    def __init__(self, linear: torch.nn.Linear, weight_id: int, path: str) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.out_features, self.in_features = linear.out_features, linear.in_features
        self.lora_kind, self.lora_layer = kind_and_layer(path) or (None, 0)  # where a step's adapters apply
        # A graph holds the id as a constant: stable across processes (the model's name and
        # the layer's), so a restarted worker's graph is the one stored.
        self.weight_id = weight_id
        # One row's product by preheat's bf16 kernel where it runs (a constant of the graph).
        self.matvec = linear.weight.dtype == torch.bfloat16 and linear.weight.is_cpu and cpukernels.available()
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout, once packed
        if weight_id in _LAYERS:
            raise RuntimeError(f"packed weight {weight_id} is already in use (two models of one name?)")
        _LAYERS[weight_id] = self

    def pack(self) -> None:
        """The weight packed for oneDNN's many-row products (again after a level-1 sleep)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)

    def unpack(self) -> None:
        """The packed copy given back (a level-1 sleep); products run on the weight until packed again."""
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return torch.nn.functional.linear(x, self.weight, self.bias)
        # The step's adapters, where it has some and this layer is one they apply to: each
        # token through its own adapter's columns only (preheat.workers.engine.cpukernels).
        step = STEP_ADAPTERS if STEP_ADAPTERS.on and self.lora_kind is not None else None
        stacks = (step.a[self.lora_kind][self.lora_layer], step.b[self.lora_kind][self.lora_layer]) if step else None
        if x.shape[-2] != 1:  # many rows: oneDNN, the adapters added inside the same op
            if stacks is None:
                return torch.ops.preheat.packed_linear(x, self.weight_id, self.out_features)
            return torch.ops.preheat.packed_linear_lora(x, self.weight_id, self.out_features, *stacks, step.columns)
        # One row: stream the weights (see the module's docstring).
        if self.matvec:
            y = torch.ops.preheat.matvec_bf16(x, self.weight)
        else:
            y = (x.unsqueeze(-2).float() * self.weight.float()).sum(-1)
        y = (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        return y if stacks is None else torch.ops.preheat.lora_add(x, y, *stacks, step.columns)

    def release(self) -> None:
        self.packed = None
        if _LAYERS.get(self.weight_id) is self:
            del _LAYERS[self.weight_id]


def pack_linear_layers(model: torch.nn.Module, owner: str) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """Every nn.Linear of the model (the output head too) made a _CompiledLinear; returns what
    was replaced, to put back (`unpack_linear_layers`). `owner`: the model's name."""
    replaced = []
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                weight_id = zlib.crc32(f"{owner}/{path}.{name}".encode())
                setattr(parent, name, _CompiledLinear(child, weight_id, f"{path}.{name}" if path else name))
                replaced.append((parent, name, child))
    return replaced


def unpack_linear_layers(replaced: list[tuple[torch.nn.Module, str, torch.nn.Linear]]) -> None:
    for parent, name, linear in replaced:
        getattr(parent, name).release()
        setattr(parent, name, linear)
