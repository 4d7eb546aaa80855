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
(preheat.workers.engine.smallstep). The linear layers are preheat's (preheat.workers.engine.linears).

**How a graph is kept.** On the CPU a kind of step without adapter rows is an AOTInductor
package (preheat.workers.engine.aotgraph), loaded by torch's C++ loader with no inductor
import; the adapters' kinds, CUDA, and any kind whose packaging fails are torch.compile's
ahead-of-time graphs (`aot_compile`), saved and loaded by torch.compile's own API. On CUDA
the decode steps replay CUDA graphs besides (preheat.workers.engine.cudagraphs).

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
from dataclasses import dataclass
from pathlib import Path

import torch

from preheat.workers.engine import aotgraph, attention
from preheat.workers.engine.linears import STEP_ADAPTERS, pack_linear_layers, unpack_linear_layers
from preheat.workers.engine.lorastack import AdapterStack, Stacked, Targets, step_columns
from preheat.workers.engine.raggedkv import RaggedKV, Segment
from preheat.workers.engine.smallstep import SmallStepKernel

log = logging.getLogger(__name__)

MODES = ("auto", "off")
# The steps every graph is made and run on at start, (slot, ids) per row: one token (the
# one-token graph, or the small-step kernel); a chunk of three beside a row decoding; a chunk
# alone (a second shape of the many-token graph: a trace specialised on the first fails here).
WARM_UP = ([(0, (1,))], [(0, (2,)), (1, (1, 2, 3))], [(2, (4, 5))])


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


@dataclass(frozen=True)
class CompileReport:
    """What a start or a wake did about the graphs: the history job's columns."""

    source: str  # compiled | restored | eager
    ms: float = 0.0
    reason: str | None = None  # why eager
    kernels_built: int = 0  # kernel libraries a restore built that its entry lacked


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
        self._packing_ms = 0.0  # the packing's time so far, while idle (`pack_next`)
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
        return plain or (
            self.small_step.adapts and self.stack is not None and self.stack.targets.dtype is torch.bfloat16
        )

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
            except aotgraph.InputsRefused as exc:
                self._refuse(kind, exc)
            except RuntimeError as exc:
                if "GuardManager check failed" not in str(exc):
                    raise
                self._refuse(kind, exc)
            finally:
                STEP_ADAPTERS.clear()
        return logits[: len(segments)]

    def _refuse(self, kind: str, exc: Exception):
        if kind not in self._refused:  # once per kind: a steady mismatch would flood the log
            self._refused.add(kind)
            log.warning("model %s: a %s step its graph refused runs eager (%s)", self.name, kind, exc)
        raise GraphRefused(kind) from exc

    def _make(self, kind: str, args: tuple) -> object:
        """The graph of `kind`, loaded from `folder` or compiled ahead on `args` (a step of
        that kind, run by `compile`) and saved there: a package where the kind is packaged
        and that works, else torch.compile's graph."""
        graph = self._package(kind, args) if self.folder is not None and self._packaged(kind) else None
        if graph is None:
            path = self.folder / f"{kind}.graph" if self.folder is not None else None
            graph = self._load(kind, path) if path is not None and path.is_file() else None
            graph = graph or self._compile(kind, args, path)
        self._graphs[kind] = graph
        return graph

    def _packaged(self, kind: str) -> bool:
        """Whether `kind` is kept as an AOTInductor package (preheat.workers.engine.aotgraph)."""
        return self.device.type == "cpu" and not kind.endswith("+lora")

    def _package(self, kind: str, args: tuple) -> aotgraph.PackagedGraph | None:
        """The package of `kind` loaded from `folder`, or exported and compiled on `args`;
        None where either fails (said once): the kind is then torch.compile's."""
        path, one_token = self.folder / f"{kind}.pt2", kind.startswith("one")
        if path.is_file():
            try:
                graph = aotgraph.PackagedGraph(path, self.model, one_token)
                self.made["loaded"] += 1
                return graph
            except Exception as exc:  # whatever torch's loader raises, the answer is a compile
                log.warning("model %s: the saved %s package does not load (%s): compiling", self.name, kind, exc)
                path.unlink(missing_ok=True)
        try:
            graph = aotgraph.package(self._forward, tuple(tensor.clone() for tensor in args), one_token, path)
        except Exception as exc:  # export or inductor: the kind keeps torch.compile's graph
            log.warning(
                "model %s: its %s step is not packaged (%s): a torch.compile graph", self.name, kind, error_line(exc)
            )
            path.unlink(missing_ok=True)
            return None
        self.made["compiled"] += 1
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
        model, through the steps of WARM_UP (a package loaded from the store skips the last).
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
                compiled_before = self.made["compiled"]
                for number, step in enumerate(WARM_UP):
                    segments = [Segment(slot, scratch.lengths[slot], ids) for slot, ids in step]
                    rows = None if adapters is None else [adapters[i % 2] for i in range(len(segments))]
                    if number == 2 and self._proven(self.kind(segments, rows), compiled_before):
                        break  # the chunk alone: a second shape of the many-token graph
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

    def _proven(self, kind: str, compiled_before: int) -> bool:
        """Whether `kind`'s graph is a package loaded from the store, none compiled here: the
        process that compiled it ran it on every warm-up shape before it stored it, and the
        store proved its bytes, so a second shape here would cost a step (30 ms) for nothing."""
        return self.made["compiled"] == compiled_before and isinstance(self._graphs.get(kind), aotgraph.PackagedGraph)

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
        for layer in self._layers():
            layer.unpack()

    def resume(self) -> None:
        """After a level-1 wake: the same graphs run at once (no compile, no restore), the
        weights packed again while idle (`pack_next`)."""
        self.ready = True

    def pack_next(self) -> bool:
        """One linear layer's weight packed for oneDNN, the next not packed yet (linears.py:
        until then its products run on the weight); whether any is left. The scheduler calls it
        while no request waits or runs, one layer at a time: a request that comes meanwhile
        waits for one layer's packing (a few ms; the output head's tens), not for all of them."""
        unpacked = self.unpacked()
        if unpacked:
            started = time.perf_counter()
            unpacked[0].pack()
            self._packing_ms += (time.perf_counter() - started) * 1000
            if len(unpacked) == 1:
                log.info("model %s: weights packed for oneDNN in %.0f ms, while idle", self.name, self._packing_ms)
                self._packing_ms = 0.0
        return len(unpacked) > 1

    def unpacked(self) -> list:
        """The linear layers whose weights are not packed yet, in the model's order."""
        return [layer for layer in self._layers() if layer.packed is None]

    def _layers(self) -> list:
        return [getattr(parent, name) for parent, name, _ in self._replaced]


def error_line(exc: Exception) -> str:
    """An exception as one log line: its type and its message's first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


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
