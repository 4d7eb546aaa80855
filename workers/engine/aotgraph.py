"""A compiled step as an AOTInductor package: exported once, compiled with its C++ wrapper into
one shared library, saved as a `.pt2` file and loaded by torch's C++ loader.

Why not only torch.compile's saved graphs (preheat.workers.engine.compiled): loading one runs
the Python module inductor generated for it, which imports most of inductor (its lowerings,
templates, memory planning): 1.1-1.2 s of a 1.1-1.8 s restore of the real model's graphs on 2
cores, profiled. A package loads in 7 ms and imports nothing, so a restarted worker's steps
cost what their files' copy and proof cost.

**The model's tensors are inputs**, not constants baked in: a package then holds no weights
(5 MB for the real model, not 270), and torch's loader, which keeps a reference to every
constant tensor it is handed, holds none of them, so a sleep can free them. Each call passes
the model's parameters and buffers (`lifted`), whose data a sleep and a wake swap in place.

**What is packaged**: a step's kind without adapter rows on the CPU (the adapters' stacks are
read from a global the trace cannot lift; CUDA keeps torch.compile's graphs, and its decode
steps replay CUDA graphs of their own: preheat.workers.engine.cudagraphs). A kind that
cannot be exported or packaged keeps torch.compile's graph, said once in the log.

**Inputs are checked by value** before the library reads them: it has no guards, so a step
whose ids, positions or kept rows are not the dtype, rank or sizes it was exported for is
refused (`InputsRefused`) and runs eager, as a graph's failed guard does.
"""

from __future__ import annotations

from pathlib import Path

import torch

INTEGER = torch.int64  # ids, positions and kept rows, as RaggedKV.step_inputs makes them


class InputsRefused(Exception):
    """A step's inputs are not what the package was exported for; nothing ran."""


def lifted(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers in the order the package takes them."""
    return [tensor for _, tensor in model.named_parameters()] + [tensor for _, tensor in model.named_buffers()]


class _Inner(torch.nn.Module):
    """The traced step as a module holding the model, so its tensors can be swapped for inputs."""

    def __init__(self, forward) -> None:
        super().__init__()
        self.model, self.step = forward.model, forward

    def forward(self, input_ids, position_ids, logits_to_keep):
        return self.step(input_ids, position_ids, logits_to_keep)


class _Lifted(torch.nn.Module):
    """What is exported: the step over the model's tensors passed in (`lifted`'s order)."""

    def __init__(self, forward) -> None:
        super().__init__()
        self.inner = _Inner(forward)
        model = forward.model
        self.names = [f"model.{name}" for name, _ in model.named_parameters()]
        self.names += [f"model.{name}" for name, _ in model.named_buffers()]

    def forward(self, tensors, input_ids, position_ids, logits_to_keep):
        swapped = dict(zip(self.names, tensors, strict=True))
        return torch.func.functional_call(self.inner, swapped, (input_ids, position_ids, logits_to_keep))


class PackagedGraph:
    """A loaded package; called as a torch.compile graph is: (forward, ids, positions, keep)."""

    def __init__(self, path: Path, model: torch.nn.Module, one_token: bool) -> None:
        # Listed once (0.7 ms a step on the real model): a sleep swaps the parameters' data,
        # never the parameters, so each call still passes what the model holds now.
        self.tensors, self.one_token = lifted(model), one_token
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def refusal(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> str | None:
        """Why these inputs are not the package's, or None."""
        for name, tensor, rank in (("ids", ids, 2), ("positions", positions, 2), ("kept rows", keep, 1)):
            if tensor.dtype != INTEGER or tensor.dim() != rank or tensor.device.type != "cpu":
                return f"{name}: {tensor.dtype} of rank {tensor.dim()} on {tensor.device.type}"
        tokens, rows = ids.shape[-1], keep.shape[0]
        if ids.shape != positions.shape or ids.shape[0] != 1:
            return f"ids {tuple(ids.shape)} against positions {tuple(positions.shape)}"
        fits = (tokens, rows) == (1, 1) if self.one_token else tokens >= 2 and rows >= 2
        if not fits:
            return f"{tokens} tokens and {rows} kept rows"
        return None

    def __call__(self, forward, ids, positions, keep) -> torch.Tensor:
        if (why := self.refusal(ids, positions, keep)) is not None:
            raise InputsRefused(why)
        return self._loader.run([*self.tensors, ids, positions, keep])[0]


def package(forward, example: tuple[torch.Tensor, ...], one_token: bool, path: Path) -> PackagedGraph:
    """The step traced on `example` (ids, positions, kept rows), the number of tokens and of
    rows symbolic unless `one_token`, compiled into the package at `path`, and loaded."""
    ids, positions, keep = example
    tensors = lifted(forward.model)
    if one_token:
        shapes = None
    else:
        tokens, rows = torch.export.Dim("tokens", min=2), torch.export.Dim("rows", min=2)
        shapes = ([None] * len(tensors), {1: tokens}, {1: tokens}, {0: rows})
    exported = torch.export.export(
        _Lifted(forward), (tensors, ids, positions, keep), dynamic_shapes=shapes, strict=False
    )
    from torch._inductor import aoti_compile_and_package  # inductor is imported to compile only

    path.parent.mkdir(parents=True, exist_ok=True)
    aoti_compile_and_package(exported, package_path=str(path))
    return PackagedGraph(path, forward.model, one_token)
