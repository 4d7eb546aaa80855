"""The KV of the requests running together, and the one forward pass each step makes over them.

Each running request (a *row*) holds a *slot* of one key and one value buffer per layer,
``[slots, kv_heads, capacity, head_dim]``: its positions sit at the left of its slot, the rest
of the slot is spare. A step feeds every row what it needs now, packed into one sequence: one
id for a row that decodes, the next chunk of its prompt for a row that pre-fills. Each
layer's new keys and values are written into the rows' slots (``update``, which the model
calls as it would a transformers cache) and the attention (``attention``, through preheat's
attention implementation, workers/attention.py) is computed per row: every decoding row in
one batched call over the slots, each pre-filling chunk against its own row. So a step costs
the tokens it feeds, not rows x the longest feed, and a pre-fill rides in the decode step
instead of stalling it (docs/architecture.md, "One pass per step").

A sliding-window layer of a row that joined from a cached prefix holds only the window's
last positions: the row's *offset* is the position its column 0 holds in those layers. A
row leaving frees its slot by moving the last row into it (one row copied, not the batch).
This is bookkeeping over tensors, tested without a model (tests/workers/engine/test_raggedkv.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from preheat.workers.engine import cpukernels
from preheat.workers.engine.kvtensors import layers_that_grow_by_concatenation


@dataclass(frozen=True)
class Segment:
    """What one row feeds in a step: `ids` at positions `start`, `start + 1`, ..."""

    slot: int
    start: int
    ids: tuple[int, ...]


@dataclass
class Layout:
    """A step's packed feed, as the attention of every layer reads it."""

    kv: RaggedKV
    segments: list[Segment]
    decoding: list[int] = field(default_factory=list)  # indices into segments that feed one id
    first: list[int] = field(default_factory=list)  # index of each segment's first packed token
    _memo: dict = field(default_factory=dict)  # masks and indices, made once a step

    def __post_init__(self) -> None:
        at = 0
        for i, segment in enumerate(self.segments):
            self.first.append(at)
            at += len(segment.ids)
            if len(segment.ids) == 1:
                self.decoding.append(i)
        self.tokens = at
        self.lone_token = len(self.segments) == 1 and at == 1  # a single user decoding

    def lone(self, window: int | None) -> tuple[int, int, torch.Tensor | None]:
        """(slot, the column its new position goes to, the mask or None) of a step feeding one
        row one token, made once a step: every layer of that step asks (a single user's
        decode costs this per layer, 30 times a token on the real model)."""
        if ("lone", window) not in self._memo:
            kv, slot = self.kv, self.segments[0].slot
            mask = self.chunk_mask(0, window)[0] if window and kv.lengths[slot] + 1 > window else None
            self._memo["lone", window] = (slot, kv.columns(slot, window), mask)
        return self._memo["lone", window]

    def one_query_rows(self, window: int | None) -> tuple[torch.Tensor, int]:
        """([rows, 3] int64: packed token, slot, columns seen; the most columns) of the rows that
        feed one query and see every column they hold (the lone row while its window has not
        slid; the decoding rows on a layer without a window): what preheat's bf16 attention
        kernel reads, made once a step."""
        if ("rows", window) not in self._memo:
            if self.lone_token:
                slot, column, _ = self.lone(window)
                rows = torch.tensor([[0, slot, column + 1]])
            else:
                slots, columns, tokens = self.decode_index(window)
                rows = torch.stack((tokens.cpu(), slots.cpu(), columns.cpu() + 1), dim=1)
            self._memo["rows", window] = (rows, int(rows[:, 2].max()))
        return self._memo["rows", window]

    def attend(self, query, keys, values, scaling, sliding_window=None) -> torch.Tensor:
        """This step's attention for one layer (`attention`): what workers/attention.py calls."""
        return attention(query, keys, values, self, scaling, sliding_window)

    def decode_index(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, columns written, packed tokens) of the decoding rows, made once a step."""
        if ("index", window) not in self._memo:
            rows = [self.segments[i] for i in self.decoding]
            self._memo["index", window] = tuple(
                torch.tensor(values, dtype=torch.long, device=self.kv.device)
                for values in (
                    [segment.slot for segment in rows],
                    [self.kv.columns(segment.slot, window) for segment in rows],
                    [self.first[i] for i in self.decoding],
                )
            )
        return self._memo["index", window]

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[slots, 1, 1, columns]: the columns each slot's one query may see (slots that do
        not decode this step see their column 0, so their throw-away output stays finite)."""
        if ("decode", window) not in self._memo:
            kv, rows = self.kv, [self.segments[i] for i in self.decoding]
            columns = max(kv.columns(segment.slot, window, after=1) for segment in rows)
            first = torch.tensor([kv.offsets[segment.slot] if window else 0 for segment in rows])
            at = torch.tensor([segment.start for segment in rows])[:, None]
            held = first[:, None] + torch.arange(columns)[None, :]  # the position each column holds
            visible = held <= at
            if window:
                visible &= held > at - window
            seen = torch.zeros((len(kv), columns), dtype=torch.bool)
            seen[:, 0] = True
            seen[[segment.slot for segment in rows]] = visible
            self._memo["decode", window] = (seen[:, None, None, :].to(kv.device), columns)
        return self._memo["decode", window]

    def chunk_mask(self, i: int, window: int | None) -> tuple[torch.Tensor, int]:
        if (i, window) not in self._memo:
            kv, segment = self.kv, self.segments[i]
            columns = kv.columns(segment.slot, window, after=len(segment.ids))
            self._memo[i, window] = (_visible(kv, segment, window, columns)[None, None].to(kv.device), columns)
        return self._memo[i, window]


def _visible(kv: RaggedKV, segment: Segment, window: int | None, columns: int) -> torch.Tensor:
    """[len(ids), columns]: which columns of its slot each fed position attends to: those at
    or before it, and within `window` positions of it on a sliding layer."""
    first = kv.offsets[segment.slot] if window else 0  # the position column 0 holds
    held = first + torch.arange(columns)[None, :]
    at = segment.start + torch.arange(len(segment.ids))[:, None]
    seen = held <= at
    if window:
        seen &= held > at - window
    return seen


class RaggedKV:
    """The running rows' KV of one model. Acts as the model's cache for a step (``update``);
    the attention of that step reads it back through ``Layout``."""

    def __init__(self, shell, device: torch.device) -> None:
        """`shell`: an empty transformers ``DynamicCache`` of the model (``DynamicCache(config=…)``):
        which layers keep a sliding window, and of what size."""
        if not batchable(shell):
            raise TypeError("only caches whose layers grow by concatenation can run together")
        self.shell = shell
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.windows = [getattr(layer, "sliding_window", None) for layer in shell.layers]
        self.buffers: list[list[torch.Tensor] | None] = [None] * len(self.windows)  # per layer [keys, values]
        self.capacity = (0, 0)  # (slots, columns) every layer's buffers have room for
        self.lengths: list[int] = []  # positions each slot's row holds
        self.offsets: list[int] = []  # the position column 0 of a sliding layer holds
        self.layout: Layout | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold, spare slots and columns included."""
        return sum(t.untyped_storage().nbytes() for pair in self.buffers if pair for t in pair)

    def columns(self, slot: int, window: int | None, after: int = 0) -> int:
        """Columns the row in `slot` fills on a layer (of sliding `window`), `after` more positions."""
        return self.lengths[slot] + after - (self.offsets[slot] if window else 0)

    # Rows join and leave ---------------------------------------------------------------

    @torch.inference_mode()  # the buffers are made in the pass: inference tensors
    def add(self, row_cache, room: int = 0) -> int:
        """A row joins from its starting cache (batch size 1; None: nothing cached), copied
        into a new slot with `room` positions in all (the buffers grow to it now, not while
        it decodes); returns the slot."""
        slot = len(self.lengths)
        length = row_cache.get_seq_length() if row_cache is not None else 0
        if not slot and max(room, length) > self.capacity[1]:
            # The first row, and buffers adopted from a batch before (ModelRunner.new_batch) too
            # short for it: nothing to copy, so made at its size, not grown from theirs.
            self.buffers, self.capacity = [None] * len(self.buffers), (0, 0)
        held = [min(length, layer.keys.shape[-2]) for layer in row_cache.layers] if length else []
        offset = length - min((h for h, w in zip(held, self.windows, strict=False) if w), default=length)
        self.lengths.append(length)
        self.offsets.append(offset)
        self._reserve(slot + 1, max(room, length))
        if row_cache is None or not length:
            return slot
        for index, (layer, n) in enumerate(zip(row_cache.layers, held, strict=True)):
            keys, values = self._buffers(index, layer.keys)
            keys[slot, :, :n] = layer.keys[0, :, layer.keys.shape[-2] - n :]
            values[slot, :, :n] = layer.values[0, :, layer.values.shape[-2] - n :]
        return slot

    @torch.inference_mode()
    def remove(self, slot: int) -> int | None:
        """The row in `slot` leaves; the last row moves into its slot. Returns the slot it
        moved from (None when the leaving row was the last)."""
        last = len(self.lengths) - 1
        if slot != last:
            for pair, window in zip(self.buffers, self.windows, strict=True):
                if pair is None:
                    continue
                keys, values = pair
                n = self.columns(last, window)
                keys[slot, :, :n] = keys[last, :, :n]
                values[slot, :, :n] = values[last, :, :n]
            self.lengths[slot], self.offsets[slot] = self.lengths[last], self.offsets[last]
        self.lengths.pop()
        self.offsets.pop()
        return last if slot != last else None

    @torch.inference_mode()
    def row(self, slot: int):
        """The row's KV alone, as a plain transformers cache of its own storage: what a
        finished request leaves cached."""
        single = _empty_like(self.shell)
        for layer, pair, window in zip(single.layers, self.buffers, self.windows, strict=True):
            keys, values = pair
            n = self.columns(slot, window)
            kept = min(n, window - 1) if window else n
            layer.lazy_initialization(keys[:1], values[:1])
            layer.keys = keys[slot : slot + 1, :, n - kept : n].clone()
            layer.values = values[slot : slot + 1, :, n - kept : n].clone()
            if window:
                layer.cumulative_length = self.lengths[slot]
        return single

    # A step --------------------------------------------------------------------------

    def step_inputs(self, segments: list[Segment]) -> dict:
        """What the step's one forward pass takes: every segment's ids packed into one
        sequence at their own positions, the logits kept at each segment's last id."""
        ids = [i for segment in segments for i in segment.ids]
        positions = [segment.start + k for segment in segments for k in range(len(segment.ids))]
        last = torch.tensor(self._begin(segments))
        device = self.device
        return {
            "input_ids": torch.tensor([ids], dtype=torch.long, device=device),
            "position_ids": torch.tensor([positions], dtype=torch.long, device=device),
            # A 4D mask is taken as given: transformers builds none; `attention` makes its own.
            "attention_mask": torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
            "logits_to_keep": last.to(device),
            # Every layer's attention is the rows' (workers/engine/attention.py), on this step.
            "preheat_rows": True,
        }

    @torch.inference_mode()  # the buffers are made in the pass: inference tensors
    def small_step(self, segments: list[Segment], like: torch.Tensor) -> tuple[list[list[int]], list[int]]:
        """A step computed outside the model's forward (preheat.workers.engine.smallstep): its
        layout set, room made for the new positions and every layer's buffers made (heads, head
        size and dtype of `like`, a layer's key tensor). Returns each fed token's [slot, column,
        position] and the packed index of each segment's last token. Layers without a window only."""
        last = self._begin(segments)
        for index in range(len(self.buffers)):
            self._buffers(index, like)
        where = [
            [segment.slot, self.columns(segment.slot, None) + k, segment.start + k]
            for segment in segments
            for k in range(len(segment.ids))
        ]
        return where, last

    def _begin(self, segments: list[Segment]) -> list[int]:
        """A step's layout set and room made for what it feeds; the packed index of each
        segment's last id (whose logits the step keeps)."""
        self.layout = Layout(self, segments)
        self._reserve(len(self.lengths), max(self.columns(s.slot, None, after=len(s.ids)) for s in segments))
        return [first + len(segment.ids) - 1 for first, segment in zip(self.layout.first, segments, strict=True)]

    def stepped(self) -> None:
        """After the step's pass: every row holds what it fed."""
        for segment in self.layout.segments:
            self.lengths[segment.slot] = segment.start + len(segment.ids)
        self.layout = None

    def snapshot(self) -> list[int]:
        """The state before a step: a pass that fails half-way is undone with `restore`
        (what it wrote past each row's length is never read)."""
        return list(self.lengths)

    def restore(self, snapshot: list[int]) -> None:
        self.lengths, self.layout = list(snapshot), None

    # What the model calls --------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the step's new keys and values ([1, kv_heads, tokens, head_dim]) into each
        row's slot; the buffers go to `attention`, which reads them with the layout."""
        layout, window = self.layout, self.windows[layer_idx]
        keys, values = self._buffers(layer_idx, key_states)
        if layout.lone_token:  # a single user decoding
            slot, column, _ = layout.lone(window)
            keys[slot, :, column] = key_states[0, :, 0]
            values[slot, :, column] = value_states[0, :, 0]
            return keys, values
        if len(layout.segments) == 1:  # one row's chunk: its columns, sliced
            slot, begin, n = layout.segments[0].slot, self.columns(layout.segments[0].slot, window), layout.tokens
            keys[slot, :, begin : begin + n] = key_states[0]
            values[slot, :, begin : begin + n] = value_states[0]
            return keys, values
        if layout.decoding:
            slots, columns, tokens = layout.decode_index(window)
            keys[slots, :, columns] = key_states[0, :, tokens].transpose(0, 1)
            values[slots, :, columns] = value_states[0, :, tokens].transpose(0, 1)
        for i, segment in enumerate(layout.segments):
            if len(segment.ids) > 1:
                begin, n, at = self.columns(segment.slot, window), len(segment.ids), layout.first[i]
                keys[segment.slot, :, begin : begin + n] = key_states[0, :, at : at + n]
                values[segment.slot, :, begin : begin + n] = value_states[0, :, at : at + n]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    # Buffers ---------------------------------------------------------------------------

    def reserve(self, slots: int, columns: int) -> None:
        """Room for exactly `slots` rows of `columns` positions, made now (buffers kept for a
        model's life: preheat.workers.engine.cudagraphs)."""
        self._reserve(slots, columns, spare=False)

    def adopt(self, buffers: list[list[torch.Tensor]], capacity: tuple[int, int]) -> None:
        """An empty batch takes `buffers` (every layer's keys and values, of `capacity`) as its own."""
        self.buffers, self.capacity = [list(pair) for pair in buffers], capacity

    @torch.inference_mode()
    def _reserve(self, slots: int, columns: int, spare: bool = True) -> None:
        """Room for `slots` rows of `columns` positions. Slots grow by a quarter when short
        (rows join one by one: each would copy the buffers otherwise); columns to what is
        asked, which is what the rows may need (`add`'s room)."""
        have_slots, have_columns = self.capacity
        if slots <= have_slots and columns <= have_columns:
            return
        self.capacity = (max(have_slots, slots + slots // 4 if spare else slots), max(have_columns, columns))
        for pair in self.buffers:
            for k, old in enumerate(pair or ()):
                grown = old.new_zeros((self.capacity[0], old.shape[1], self.capacity[1], old.shape[-1]))
                grown[: old.shape[0], :, : old.shape[-2]] = old
                pair[k] = grown

    def _buffers(self, index: int, like: torch.Tensor) -> list[torch.Tensor]:
        """Layer `index`'s keys and values, made at the capacity on first use (heads, head
        size, dtype and device of `like`, a key tensor of that layer)."""
        if self.buffers[index] is None:
            shape = (self.capacity[0], like.shape[1], self.capacity[1], like.shape[-1])
            self.buffers[index] = [like.new_zeros(shape), like.new_zeros(shape)]
        return self.buffers[index]


# One query in bfloat16 on the CPU, where preheat's kernel does not run it (no AVX512-BF16, a window that has
# slid: preheat.workers.engine.cpukernels): torch's SDPA costs about 0.75 µs a column a layer (937 µs at 1,200 columns,
# measured on 2 cores), the same in float32 with the casts 69-250 µs; below this many columns bfloat16's own is
# faster (52 against 69 µs at 40). The real model's one-row step at a 1,024-token context: 49.5 ms before.
ONE_ROW_FLOAT32_FROM = 128


def attention(query, keys, values, layout: Layout, scaling, sliding_window=None) -> torch.Tensor:
    """The step's attention for one layer: [1, tokens, heads, head_dim], each fed position
    against its own row only (what `RaggedKV.update` returned: the layer's buffers)."""
    window = sliding_window or None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5  # SDPA's default
    if layout.lone_token:
        # One row decoding (a single user): every column it holds is seen, unless a window has slid.
        slot, column, mask = layout.lone(window)
        columns = column + 1
        if mask is None and cpukernels.attends(query, keys):  # bf16 on the CPU: preheat's kernel
            rows, most = layout.one_query_rows(window)
            return cpukernels.attend_rows(query, keys, values, rows, most, scale)
        query_in, keys_in, values_in = query, keys[slot : slot + 1, :, :columns], values[slot : slot + 1, :, :columns]
        cast = query.dtype is not torch.float32 and layout.kv.on_cpu and columns >= ONE_ROW_FLOAT32_FROM
        if cast:
            query_in, keys_in, values_in = query.float(), keys_in.float(), values_in.float()
        seen = sdpa(query_in, keys_in, values_in, attn_mask=mask, scale=scaling, enable_gqa=True)
        return (seen.to(query.dtype) if cast else seen).transpose(1, 2)
    out = query.new_empty((1, query.shape[2], query.shape[1], query.shape[-1]))
    if layout.decoding and window is None and cpukernels.attends(query, keys):  # bf16 on the CPU: preheat's kernel
        rows, most = layout.one_query_rows(window)
        cpukernels.attend_rows(query, keys, values, rows, most, scale, out)
    elif layout.decoding:
        mask, columns = layout.decode_mask(window)
        slots, _, tokens = layout.decode_index(window)
        queries = query.new_zeros((len(layout.kv), query.shape[1], 1, query.shape[-1]))
        queries[slots, :, 0] = query[0, :, tokens].transpose(0, 1)
        rows = len(layout.kv)
        seen = decode_attention(queries, keys[:rows, :, :columns], values[:rows, :, :columns], mask, scaling)
        out[0, tokens] = seen[slots, :, 0]
    for i, segment in enumerate(layout.segments):
        if len(segment.ids) > 1:
            mask, columns = layout.chunk_mask(i, window)
            at, n, slot = layout.first[i], len(segment.ids), segment.slot
            seen = sdpa(
                query[:, :, at : at + n],
                keys[slot : slot + 1, :, :columns],
                values[slot : slot + 1, :, :columns],
                attn_mask=mask,
                scale=scaling,
                enable_gqa=True,
            )
            out[0, at : at + n] = seen[0].transpose(0, 1)
    return out


def decode_attention(queries, keys, values, mask, scaling) -> torch.Tensor:
    """Every row's one query against its slot, [rows, heads, 1, head_dim]: the grouped heads as
    one batched product, as transformers' eager attention computes it (softmax in float32).
    torch's SDPA with a mask costs 2.5 ms a layer here at 16 rows (its CPU flash kernel), this
    a tenth of it."""
    rows, heads, _, head_dim = queries.shape
    grouped = queries.view(rows, keys.shape[1], heads // keys.shape[1], head_dim)
    scale = scaling if scaling is not None else head_dim**-0.5
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    seen = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
    return seen.view(rows, heads, 1, head_dim)


def batchable(cache) -> bool:
    """Whether a request's cache can run with the others: every layer a plain or
    sliding-window DynamicCache layer (quantized and linear-attention layers keep state of
    other shapes)."""
    return all(type(layer) in layers_that_grow_by_concatenation() for layer in cache.layers)


def _empty_like(shell):
    """A new cache with the layer types of `shell` (a shallow copy of its empty layers)."""
    import copy

    single = copy.copy(shell)
    single.layers = [copy.copy(layer) for layer in shell.layers]
    for layer in single.layers:
        layer.keys = layer.values = None
        layer.is_initialized = False
        if getattr(layer, "sliding_window", None):
            layer.cumulative_length = 0
    return single
