"""The KV of the requests decoding together, as one left-padded cache.

Each running request (a *row*) started from its own cached prefix and has its own length.
The batch holds them in one transformers ``DynamicCache`` of batch size B, right-aligned:
row i's real positions are the last ``lengths[i]`` columns of every full-attention layer
and the last ``min(lengths[i], window - 1)`` columns of a sliding-window layer; the
columns before are zeros, masked out by the attention mask this class writes. One decode
step feeds one token per row and grows every layer by one column (``torch.cat``, as a
DynamicCache always does), so the step is a single forward pass for all B requests.

A row joins with one copy of its KV into the batch (the prefix entry it came from is
only read, never written or held), and leaves by an index select; the columns no row
needs any more are dropped when the longest row leaves. This is bookkeeping over tensors:
it is tested without a model (tests/workers/test_batchkv.py).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicLayer

from workers.prefix import clone_for_request, layers_that_grow_by_concatenation


class GrowingLayer(DynamicLayer):
    """A full-attention layer of the batch that grows in place: its tensors are the batch's
    own (rows join by copy), so a step writes its one new column into spare capacity instead
    of copying the whole layer (DynamicLayer's torch.cat: a third of a 16-row step on the
    135 M model, measured). Capacity grows by half when full; a layer whose tensors were
    replaced (a row joined or left) is copied into a new buffer at its next step."""

    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    _views: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        used, new = self.keys.shape[-2], key_states.shape[-2]
        if self._views is None or self._views[0] is not self.keys or used + new > self._buffers[0].shape[-2]:
            self._buffers = tuple(_with_room(t, used + new) for t in (self.keys, self.values))
        for buffer, states in zip(self._buffers, (key_states, value_states), strict=True):
            buffer[..., used : used + new, :] = states
        self.keys, self.values = (buffer[..., : used + new, :] for buffer in self._buffers)
        self._views = (self.keys, self.values)
        return self.keys, self.values


def _with_room(tensor: torch.Tensor, needed: int) -> torch.Tensor:
    capacity = needed + max(16, needed // 2)
    buffer = tensor.new_empty((*tensor.shape[:-2], capacity, tensor.shape[-1]))
    buffer[..., : tensor.shape[-2], :] = tensor
    return buffer


class BatchKV:
    def __init__(self, shell) -> None:
        self.cache = shell  # a DynamicCache of batch size 0 (see `like`)
        self.lengths: list[int] = []
        self.width = 0  # columns of a full-attention layer: the longest row

    @classmethod
    def like(cls, row_cache) -> BatchKV:
        """An empty batch with the layer types (and windows) of `row_cache`."""
        if not batchable(row_cache):
            raise TypeError("only caches whose layers grow by concatenation can be batched")
        shell = clone_for_request(row_cache)
        for layer in shell.layers:
            layer.keys, layer.values = layer.keys[:0], layer.values[:0]
            if _window(layer):
                layer.cumulative_length = 0
            else:
                layer.__class__ = GrowingLayer
        return cls(shell)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes the batch holds, spare capacity included."""
        return sum(t.untyped_storage().nbytes() for layer in self.cache.layers for t in (layer.keys, layer.values))

    def add(self, row_cache, length: int) -> int:
        """Append a request's KV (batch size 1, its last `length` positions; 0: a row of
        padding only, whose positions the next forward pass feeds); returns its row index."""
        width = max(self.width, length)
        for layer, row in zip(self.cache.layers, row_cache.layers, strict=True):
            columns = _columns(layer, width)
            for name in ("keys", "values"):
                row_part = _last(getattr(row, name), min(length, _columns(layer, length)))
                self._append(layer, name, row_part, columns)
        self.lengths.append(length)
        self._set_width(width)
        return len(self.lengths) - 1

    def merge(self, other: BatchKV) -> None:
        """Append every row of `other` (rows pre-filled together), after this batch's own."""
        width = max(self.width, other.width)
        for layer, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            columns = _columns(layer, width)
            for name in ("keys", "values"):
                self._append(layer, name, getattr(theirs, name), columns)
        self.lengths += other.lengths
        self._set_width(width)

    @staticmethod
    def _append(layer, name: str, rows: torch.Tensor, columns: int) -> None:
        mine = _left_pad(getattr(layer, name), columns)
        setattr(layer, name, torch.cat([mine, _left_pad(rows, columns).to(mine.dtype)], dim=0))

    def prefill_inputs(self, feeds: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
        """What one forward pass feeds to pre-fill every row at once: row i's `feeds[i]`,
        left-padded to the longest, right after its own cached positions. Each row's real
        positions stay contiguous at the right (a row with fewer ids than the longest feed
        holds no cached position: see Scheduler._prefill_together)."""
        device = self.cache.layers[0].keys.device
        width = max(len(feed) for feed in feeds)
        if any(n and len(feed) < width for n, feed in zip(self.lengths, feeds, strict=True)):
            raise ValueError("a row with cached positions must feed the longest feed (no gap inside a row)")
        ids = torch.full((len(feeds), width), pad_id, dtype=torch.long)
        positions = torch.zeros((len(feeds), width), dtype=torch.long)
        for i, feed in enumerate(feeds):
            if feed:
                ids[i, width - len(feed) :] = torch.tensor(feed, dtype=torch.long)
            positions[i, width - len(feed) :] = torch.arange(self.lengths[i], self.lengths[i] + len(feed))
        real = torch.tensor([n + len(feed) for n, feed in zip(self.lengths, feeds, strict=True)])
        mask = torch.arange(self.width + width)[None, :] >= (self.width + width - real)[:, None]
        return {
            "input_ids": ids.to(device),
            "attention_mask": mask.to(device=device, dtype=torch.long),
            "position_ids": positions.to(device),
        }

    def prefilled(self, feeds: list[list[int]]) -> None:
        """After the pre-fill pass: every row holds its cached positions and its feed."""
        width = max(len(feed) for feed in feeds)
        self.lengths = [n + len(feed) for n, feed in zip(self.lengths, feeds, strict=True)]
        self.width += width

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order); columns no kept row needs are dropped."""
        width = max((self.lengths[i] for i in rows), default=0)
        index = torch.tensor(rows, dtype=torch.long, device=self.cache.layers[0].keys.device)
        for layer in self.cache.layers:
            columns = _columns(layer, width)
            for name in ("keys", "values"):
                setattr(layer, name, _last(getattr(layer, name).index_select(0, index), columns))
        self.lengths = [self.lengths[i] for i in rows]
        self._set_width(width)

    def row(self, i: int):
        """Row i's KV alone (batch size 1, its own storage): what a finished request leaves cached."""
        single = copy.copy(self.cache)
        single.layers = [copy.copy(layer) for layer in self.cache.layers]
        for layer, mine in zip(single.layers, self.cache.layers, strict=True):
            if type(layer) is GrowingLayer:
                layer.__class__ = DynamicLayer  # a cache entry of its own: plain again
                layer.__dict__.pop("_buffers", None)
                layer.__dict__.pop("_views", None)
            own = min(self.lengths[i], mine.keys.shape[-2])
            layer.keys = _last(mine.keys[i : i + 1], own).clone()
            layer.values = _last(mine.values[i : i + 1], own).clone()
            if _window(layer):
                layer.cumulative_length = self.lengths[i]
        return single

    def step_inputs(self, next_ids: list[int]) -> dict[str, torch.Tensor]:
        """What one decode step feeds: each row's next id at its own position, and the mask
        of every row's real columns plus the one being fed."""
        device = self.cache.layers[0].keys.device
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        columns = torch.arange(self.width + 1)
        mask = columns[None, :] >= (self.width - lengths)[:, None]
        return {
            "input_ids": torch.tensor(next_ids, dtype=torch.long)[:, None].to(device),
            "attention_mask": mask.to(device=device, dtype=torch.long),
            "position_ids": lengths[:, None].to(device),
        }

    def stepped(self) -> None:
        """After a decode step: every row is one position longer."""
        self.lengths = [n + 1 for n in self.lengths]
        self.width += 1

    def snapshot(self) -> list[tuple]:
        """The layers' state before a step: a step that fails half-way is undone with `restore`."""
        return [(layer.keys, layer.values, getattr(layer, "cumulative_length", None)) for layer in self.cache.layers]

    def restore(self, snapshot: list[tuple]) -> None:
        for layer, (keys, values, cumulative) in zip(self.cache.layers, snapshot, strict=True):
            layer.keys, layer.values = keys, values
            if cumulative is not None:
                layer.cumulative_length = cumulative

    def _set_width(self, width: int) -> None:
        self.width = width
        for layer in self.cache.layers:
            if _window(layer):
                layer.cumulative_length = width


def batchable(cache) -> bool:
    """Whether a request's cache can join a batch: every layer a plain or sliding-window
    DynamicCache layer (quantized and linear-attention layers keep state of other shapes)."""
    return all(type(layer) in layers_that_grow_by_concatenation() for layer in cache.layers)


def _window(layer) -> int | None:
    return getattr(layer, "sliding_window", None)


def _columns(layer, width: int) -> int:
    """How many columns a layer holds for a batch `width` positions long."""
    window = _window(layer)
    return width if window is None else min(width, window - 1)


def _last(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    return tensor[..., tensor.shape[-2] - min(columns, tensor.shape[-2]) :, :]


def _left_pad(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    missing = columns - tensor.shape[-2]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros((*tensor.shape[:-2], missing, tensor.shape[-1]))
    return torch.cat([pad, tensor], dim=-2)
