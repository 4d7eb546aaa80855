"""Compiled steps: the running rows' forward pass as torch.compile graphs (vLLM's compiled
model runner, on the CPU as on a GPU), compiled ahead at start before the worker is ready, and
saved on disk (preheat.workers.engine.compilestore), since compilation is a cold start like
loading weights: a restarted worker loads its graphs without tracing the model again.

**What is compiled.** transformers' own modeling code of the model, whole (`fullgraph`), with
preheat's attention as one opaque op per layer (`preheat::ragged_attention`: what the step's
layout says is no tensor). Two shapes cover every step the batch runs: a step that feeds **one
token** (a single user decoding: its own graph, every size static) and a step that feeds **two
or more** (rows decoding together, pre-fill chunks beside them: one graph, the number of
tokens and of rows symbolic). So a burst of users never meets a shape that was not compiled at
start, and nothing is padded. Where a step feeds few tokens, a Llama-family model in bf16
runs it in one call of preheat's kernel instead, and has no one-token graph
(preheat.workers.engine.smallstep).

**Linear layers on the CPU.** A one-token step reads every weight once for one row: its
linear layers are written as a reduction (`(x * w).sum(-1)`), which inductor turns into loops
that stream float32 weights at memory speed (torch's GEMV for one row runs at a third of it
here: 8 GB/s against 24-29); bfloat16 weights, where the CPU multiplies bf16 pairs itself,
go through preheat's own kernel instead (preheat.workers.engine.cpukernels: twice the loops'
speed). A step of many rows uses oneDNN with the weights pre-packed for
it (`preheat::packed_linear`, an opaque op: a packed tensor cannot be a graph input). The
packed copies cost a second copy of the linear weights in memory, released with the graphs
(a sleep). On CUDA both are cuBLAS.

**Honour or refuse.** `PREHEAT_COMPILE=off` runs every step eager; `auto` compiles where the
device can (a C++ compiler on the CPU, Triton on CUDA) and, where it cannot or a compile
fails, runs eager and says why once (`CompiledSteps.eager_reason`, in `preheat workers`).
"""

from __future__ import annotations

import functools
import logging
import shutil
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from preheat.workers.engine import attention, cpukernels
from preheat.workers.engine.lorastack import AdapterStack, Stacked, Targets, kind_and_layer, step_columns
from preheat.workers.engine.raggedkv import RaggedKV, Segment
from preheat.workers.engine.smallstep import SmallStepKernel

log = logging.getLogger(__name__)

MODES = ("auto", "off")
_PACKED: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # id -> (oneDNN-packed weight, bias)


def packed_linear(x: torch.Tensor, weight_id: int, out_features: int) -> torch.Tensor:
    """A linear layer through oneDNN with its weight packed ahead (`pack_linear_layers`)."""
    packed, bias = _PACKED[weight_id]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


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


# One compiled step at a time in a process: every adapter graph reads its adapters from
# STEP_ADAPTERS, so two schedulers' adapter steps at once (two runtimes in one process: tests,
# benches) would read each other's. A worker has one scheduler thread: never contended.
_STEP_LOCK = threading.Lock()


def why_not_compiled(device: torch.device) -> str | None:
    """Why this device cannot compile steps, or None when it can."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed (torch.compile's CUDA backend needs it)"
        return None
    if device.type != "cpu":
        return f"no compiled steps on {device.type}"
    if not any(shutil.which(name) for name in ("c++", "g++", "clang++")):
        return "no C++ compiler on this machine (torch.compile's CPU backend needs one: apt-get install g++)"
    return None


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
        if weight_id in _PACKED:
            raise RuntimeError(f"packed weight {weight_id} is already in use (two models of one name?)")
        self.repack()

    def repack(self) -> None:
        """The weight packed for oneDNN again (after a level-1 sleep gave the copy back)."""
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)
        _PACKED[self.weight_id] = (packed, self.bias.detach() if self.bias is not None else None)

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
        _PACKED.pop(self.weight_id, None)


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


@dataclass(frozen=True)
class CompileReport:
    """What a start or a wake did about the graphs: the history job's columns."""

    source: str  # compiled | restored | eager
    ms: float = 0.0
    reason: str | None = None  # why eager


class GraphRefused(Exception):
    """A step's inputs failed its graph's guards (a size or dtype it was not compiled for):
    the runner runs that step eager. Nothing ran; the step's state is untouched."""


class _Forward:
    """What a graph traces: the model's pass over a step's packed rows. Its own object, holding
    nothing but the model: a saved graph's guards keep what the traced object holds."""

    def __init__(self, model, device: torch.device) -> None:
        self.model = model
        self.mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)

    def __call__(self, input_ids, position_ids, logits_to_keep):
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self.mask,
            logits_to_keep=logits_to_keep,
            use_cache=False,
            preheat_rows=True,
        )
        return out.logits[0]


class CompiledSteps:
    """One model's compiled steps. Built by the runner; `compile` runs at start (and after a
    wake) on the scheduler's thread, before the model takes requests.

    Each kind of step (`kind`: one or many tokens, with adapter rows or none) is one graph,
    compiled ahead (`aot_compile`, the step's sizes symbolic where they vary) and saved to
    `folder`, or loaded from it: a restarted worker traces nothing. A step picks its graph by
    its kind, as vLLM's model runner does, not by guards on the model; nothing is compiled on
    a request's path (a step of a kind with no graph runs eager)."""

    def __init__(self, name, model, device, *, adapters: bool = False, folder: Path | None = None) -> None:
        self.name, self.model, self.device, self.folder = name, model, device, folder
        self.ready = False
        # With `adapters` (the model declares LoRA adapters), steps with adapter rows are
        # compiled too, at start like the others; on the CPU only, where the linear layers are
        # preheat's (_CompiledLinear), which apply them. Elsewhere such steps run eager.
        self.stack = AdapterStack(Targets.of(model), device) if adapters and device.type == "cpu" else None
        self._replaced: list = []
        self._forward = _Forward(model, device)
        self._graphs: dict[str, object] = {}
        self.made = {"compiled": 0, "loaded": 0}  # graphs, by how each was made
        self._refused: set[str] = set()  # kinds whose graph refused a step's inputs (logged)
        # A step of few tokens in one kernel call, where it computes this model
        # (preheat.workers.engine.smallstep): the "one" kind then has no graph.
        self.small_step: SmallStepKernel | None = None
        configure_dynamo()

    @staticmethod
    def kind(segments: list[Segment], adapters) -> str:
        one = len(segments) == 1 and len(segments[0].ids) == 1
        return ("one" if one else "many") + ("+lora" if adapters and any(a is not None for a in adapters) else "")

    def for_step(self, kv: RaggedKV, segments: list[Segment], adapters=None):
        """The graph that runs this step (its segments' `adapters`: a LoraWeights or None
        each), or None: it runs eager."""
        kind = self.kind(segments, adapters)
        if not self.ready or (kind not in self._graphs and not self._small(segments, adapters)):
            return None
        if adapters is None or all(adapter is None for adapter in adapters):
            return self._run
        present = _distinct(adapters)
        if self.stack is None or not all(self.stack.covers(adapter) for adapter in present):
            return None
        return lambda kv, segments: self._run(kv, segments, adapters, self.stack.for_step(present))

    def _small(self, segments: list[Segment], adapters) -> bool:
        """Whether this step is the small-step kernel's: few ids, and any adapters stacked in bf16."""
        if self.small_step is None or not self.small_step.covers(segments):
            return False
        plain = adapters is None or all(adapter is None for adapter in adapters)
        return plain or (self.stack is not None and self.stack.targets.dtype is torch.bfloat16)

    def _run(self, kv: RaggedKV, segments: list[Segment], adapters=None, stack: Stacked | None = None, small=True):
        if small and self._small(segments, adapters):
            lora = (stack, step_columns([len(s.ids) for s in segments], adapters, stack)) if stack is not None else None
            with _STEP_LOCK, torch.inference_mode():  # the kernel's table of addresses is one per model
                return self.small_step(kv, segments, lora)
        kind = self.kind(segments, adapters)
        # Every input an inference tensor, as the graphs were compiled on (a guard checks it).
        with _STEP_LOCK, torch.inference_mode():
            inputs = kv.step_inputs(segments)
            ids, positions, keep = inputs["input_ids"], inputs["position_ids"], inputs["logits_to_keep"]
            if not kind.startswith("one"):
                # Two or more rows kept, so the many-token graph never meets a size of one
                # (the last is repeated and dropped after).
                keep = torch.cat([keep, keep[-1:]]) if keep.shape[0] == 1 else keep
            if stack is not None:
                lengths = [len(segment.ids) for segment in segments]
                STEP_ADAPTERS.set(stack, step_columns(lengths, adapters, stack))
            try:
                with attention.running(kv):
                    graph = self._graphs.get(kind) or self._make(kind, (ids, positions, keep))
                    logits = graph(self._forward, ids, positions, keep)
            except RuntimeError as exc:
                if "GuardManager check failed" not in str(exc):
                    raise
                if kind not in self._refused:  # once per kind: a steady mismatch would flood the log
                    self._refused.add(kind)
                    log.warning("model %s: a %s step its graph refused runs eager (%s)", self.name, kind, exc)
                raise GraphRefused(kind) from exc
            finally:
                STEP_ADAPTERS.clear()
        return logits[: len(segments)]

    def _make(self, kind: str, args: tuple) -> object:
        """The graph of `kind`, loaded from `folder` or compiled ahead on `args` (a step of
        that kind, run by `compile`) and saved there."""
        path = self.folder / f"{kind}.graph" if self.folder is not None else None
        graph = self._load(kind, path) if path is not None and path.is_file() else None
        if graph is None:
            graph = self._compile(kind, args, path)
        self._graphs[kind] = graph
        return graph

    def _load(self, kind: str, path: Path):
        """The saved graph, or None where torch refuses it (the store proved its bytes):
        that costs a compile."""
        try:
            with open(path, "rb") as file:
                graph = torch.compiler.load_compiled_function(file)
        except Exception as exc:  # whatever torch raises, the answer is a compile
            log.warning("model %s: the saved %s graph does not load (%s): compiling", self.name, kind, exc)
            return None
        self.made["loaded"] += 1
        return graph

    def _compile(self, kind: str, args: tuple, path: Path | None):
        example = tuple(tensor.clone() for tensor in args)  # marked, so not the tensors a step passes
        if not kind.startswith("one"):
            for tensor, dim in zip(example, (1, 1, 0), strict=True):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        if kind.endswith("+lora"):
            STEP_ADAPTERS.mark_dynamic(tokens=not kind.startswith("one"))
        # A copy each time: one dict given to two compiles failed the second's save.
        compiler = torch.compile(self._forward.__call__, fullgraph=True, options=dict(_OPTIONS))
        # The model's float attributes are constants of the graph: a float made symbolic makes
        # torch.compile restart its trace, which an ahead-of-time compile cannot (gemma3's).
        with torch._dynamo.config.patch(specialize_float=True):
            graph = compiler.aot_compile((example, {}))
        self.made["compiled"] += 1
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                graph.save_compiled_function(str(path))
            except OSError as exc:
                log.warning("model %s: the %s graph is not saved (%s)", self.name, kind, exc)
        return graph

    def compile(self, scratch: RaggedKV) -> float:
        """Every graph compiled (or loaded) by running it on `scratch`, an empty batch of the
        model: one token; then a chunk of three beside a row decoding; then a chunk alone.
        With adapters, the same again under two stand-in adapters (zeros, of the rank a step
        is least likely to meet alone). Returns the milliseconds it took."""
        started = time.perf_counter()
        if self.device.type == "cpu" and not self._replaced:
            self._replaced = pack_linear_layers(self.model, self.name)
            self.small_step, why_not = SmallStepKernel.of(self.model)
            if why_not:
                log.info("model %s: small steps run as graphs, not one kernel call: %s", self.name, why_not)
        stand_ins = self._stand_in_adapters() if self.stack is not None else None
        try:
            for _ in range(3):
                scratch.add(None, 16)
            for adapters in [None] + ([stand_ins] if stand_ins else []):
                for step in ([(0, (1,))], [(0, (2,)), (1, (1, 2, 3))], [(2, (4, 5))]):
                    segments = [Segment(slot, scratch.lengths[slot], ids) for slot, ids in step]
                    rows = None if adapters is None else [adapters[i % 2] for i in range(len(segments))]
                    stack = self.stack.for_step(_distinct(rows)) if rows else None
                    # The kernel runs a lone token (no one-token graph); the many-token graph is
                    # made here whatever the kernel covers: a larger step may come.
                    self._run(scratch, segments, rows, stack, small=len(step) == 1 == len(step[0][1]))
                    scratch.stepped()
        except Exception:
            self.release()
            raise
        if self.stack is not None:  # the stand-ins leave no columns behind
            self.stack = AdapterStack(self.stack.targets, self.device)
        self.ready = True
        return (time.perf_counter() - started) * 1000

    def _stand_in_adapters(self):
        """Two adapters of zeros over every target (ranks 8 and 16): what the adapter graphs
        are compiled with, before any tenant's adapter is read."""
        from preheat.workers.engine.lora import LoraWeights

        like = self.model.get_input_embeddings().weight
        made = []
        for name, rank in (("compile-stand-in-a", 8), ("compile-stand-in-b", 16)):
            layers = {
                kind.replace("*", str(layer)): (like.new_zeros((rank, i)), like.new_zeros((o, rank)))
                for kind, (count, o, i) in self.stack.targets.kinds.items()
                for layer in range(count)
            }
            made.append(LoraWeights(name, self.name, "", rank, 1.0, layers))
        return made

    def release(self) -> None:
        """The graphs no longer used and the packed weights freed (a level-2 sleep, a failed compile)."""
        self.ready = False
        self._graphs, self.small_step = {}, None
        unpack_linear_layers(self._replaced)
        self._replaced = []

    def suspend(self) -> None:
        """A level-1 sleep: the packed copies of the weights freed, the modules (and so the
        graphs, whose guards name them) kept in this process for `resume`."""
        self.ready = False
        for parent, name, _ in self._replaced:
            getattr(parent, name).release()

    def resume(self) -> float:
        """After a level-1 wake: the weights packed again, the same graphs run at once (no
        compile, no restore); returns the milliseconds it took."""
        started = time.perf_counter()
        for parent, name, _ in self._replaced:
            getattr(parent, name).repack()
        self.ready = True
        return (time.perf_counter() - started) * 1000


def _distinct(adapters) -> tuple:
    """A step's adapters (a LoraWeights or None per row), each once, in the rows' order."""
    return tuple({id(a): a for a in adapters if a is not None}.values())


def _inputs_guarded(entries) -> list[bool]:
    """The guards a saved graph keeps: the dtype, device and static sizes of the tensors the
    step passes (its inputs, the adapters' stacks). None on the model's parameters, on
    globals or on objects' identity: the step picks its graph by kind, and a guard that named
    this process's objects could not be saved."""
    return [
        entry.guard_type == "TENSOR_MATCH" and not entry.is_global and not isinstance(entry.value, torch.nn.Parameter)
        for entry in entries
    ]


# What a graph is compiled with: the guards it keeps. inductor's checks of every input's and
# custom op output's sizes and strides, in the graph's Python, are off: the saved guards
# check the inputs' (`_inputs_guarded`), and the ops' outputs are checked against
# transformers by the tests. Measured on the real model's one-row bf16 step: 0.35-0.6 ms of
# about 16.
_OPTIONS = {
    "guard_filter_fn": _inputs_guarded,
    "size_asserts": False,
    "alignment_asserts": False,
    "scalar_asserts": False,
}


@functools.cache
def configure_dynamo() -> None:
    """A failure raises (the runner runs eager and says why) instead of falling back unseen."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = False
