"""Decode steps as CUDA graphs (vLLM's capture of its decode batch sizes): on CUDA, a step in
which every row feeds one token replays a graph captured at start for the next size up in
`ROW_SIZES`, so its hundreds of kernel launches cost one.

**What a graph reads must sit at fixed addresses**, so a captured step reads nothing that
moves: its ids, positions and slots are copied into static buffers before each replay
(`StaticDecode.inputs`), and the running rows' KV buffers are the runner's own, kept for the
model's life (`reserved`) and handed to every batch it makes, sized at capture from the
batch limits (as many slots as the largest size, columns from `running_kv_bytes`). A batch
whose buffers had to grow past them (one long row) no longer matches (`covers`): its steps
run as any step no graph covers, correctly, only slower.

**Its attention is the rows' decode attention** (raggedkv.decode_attention, the same as
an eager step's) over every column of a row's slot, masked past its position: a layout
that varies by step would be baked into the graph. The rows a size pads with write into one
spare slot no row holds. Layers with a sliding window keep their columns elsewhere than at
their positions: such a model has no graphs (said once).

**Proven before use.** Each graph is replayed once on inputs other than those it was
captured with and compared with the same step run directly: the same token chosen on every
row, every logit within rounding; a value the capture baked in (a Python number, a host
copy) shows there, and the model runs without graphs, said once. A level-1 sleep moves the
weights, so the graphs go with it and are captured again on the wake.

On the CPU the same static step runs directly (no `capture_all`): how the tests prove its
answers against transformers where no GPU is lent.
"""

from __future__ import annotations

import torch

from preheat.workers.engine import attention
from preheat.workers.engine.raggedkv import RaggedKV, Segment, decode_attention

ROW_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)  # the decode steps captured, padded up to the next


class StaticDecode:
    """One model's decode step over static buffers: `rows` tokens at once, each one row's next
    token at its position in its slot of `buffers` (every layer's [keys, values])."""

    def __init__(self, model, buffers: list[list[torch.Tensor]], rows: int) -> None:
        device = buffers[0][0].device
        self.model, self.buffers, self.rows = model, buffers, rows
        self.spare = buffers[0][0].shape[0] - 1  # the slot padded rows write into
        self.columns = torch.arange(buffers[0][0].shape[2], device=device)
        self.inputs = torch.zeros((3, rows), dtype=torch.long, device=device)  # ids, positions, slots
        self.keep = torch.arange(rows, device=device)
        self.mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        self.layout = self  # what preheat::ragged_attention reads: `update`, then `layout.attend`

    def fill(self, segments: list[Segment]) -> None:
        """The step's ids, positions and slots into the static buffers, padded with the spare slot."""
        pad = self.rows - len(segments)
        staged = torch.tensor(
            [
                [s.ids[0] for s in segments] + [0] * pad,
                [s.start for s in segments] + [0] * pad,
                [s.slot for s in segments] + [self.spare] * pad,
            ]
        )
        self.inputs.copy_(staged, non_blocking=True)

    def __call__(self) -> torch.Tensor:
        """The step's logits, [rows, vocab]: the model's pass with this object as its KV."""
        with torch.inference_mode(), attention.running(self):
            return self.model(
                input_ids=self.inputs[0:1],
                position_ids=self.inputs[1:2],
                attention_mask=self.mask,
                logits_to_keep=self.keep,
                use_cache=False,
                preheat_rows=True,
            ).logits[0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Each row's new key and value ([1, kv_heads, rows, head_dim]) into its slot at its position."""
        keys, values = self.buffers[layer_idx]
        slots, positions = self.inputs[2], self.inputs[1]
        keys[slots, :, positions] = key_states[0].transpose(0, 1)
        values[slots, :, positions] = value_states[0].transpose(0, 1)
        return keys, values

    def attend(self, query, keys, values, scaling, sliding_window=None) -> torch.Tensor:
        """[1, rows, heads, head_dim]: each row's one query against its slot's columns up to its position."""
        if sliding_window:
            raise RuntimeError("a static decode step has no sliding-window layers")
        slots, positions = self.inputs[2], self.inputs[1]
        mask = (self.columns[None, :] <= positions[:, None])[:, None, None, :]
        queries = query[0].transpose(0, 1)[:, :, None].contiguous()  # [rows, heads, 1, head_dim]
        seen = decode_attention(queries, keys[slots], values[slots], mask, scaling)
        return seen[:, :, 0][None]


class DecodeGraphs:
    """A model's decode steps, one per size in `ROW_SIZES` up to its most rows, captured as CUDA
    graphs by `capture_all` (until then, run directly) over the runner's reserved KV buffers."""

    def __init__(self, model, reserved: tuple[list, tuple[int, int]], most_rows: int) -> None:
        self.reserved = reserved
        buffers, (slots, _) = reserved
        self.sizes = [size for size in ROW_SIZES if size <= most_rows and size < slots]  # the last slot is the spare
        self.steps = {size: StaticDecode(model, buffers, size) for size in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps_run = dict.fromkeys(self.sizes, 0)  # steps each size ran: the workers' view, the tests'

    @staticmethod
    def why_not(kv: RaggedKV) -> str | None:
        """Why this model's decode steps cannot be graphs, or None."""
        if any(kv.windows):
            return "its sliding-window layers keep their columns apart from their positions"
        return None

    def covers(self, kv: RaggedKV, segments: list[Segment], adapters) -> bool:
        """Whether this step replays a graph: every row one token, no adapter rows, at most the
        largest size, and the batch on the reserved buffers (growing them replaces the tensors)."""
        buffers, capacity = self.reserved
        return (
            bool(self.sizes)
            and len(segments) <= self.sizes[-1]
            and all(len(segment.ids) == 1 and segment.start < capacity[1] for segment in segments)
            and (adapters is None or all(adapter is None for adapter in adapters))
            and len(kv) < capacity[0]
            and kv.buffers[0] is not None
            and kv.buffers[0][0] is buffers[0][0]
        )

    def run(self, kv: RaggedKV, segments: list[Segment]) -> torch.Tensor:
        """The step's logits, [segments, vocab], from the graph of the next size up."""
        kv._begin(segments)  # the layout the scheduler's `stepped` reads; room is reserved already
        size = next(size for size in self.sizes if size >= len(segments))
        step = self.steps[size]
        step.fill(segments)
        self.steps_run[size] += 1
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = step()
        return out[: len(segments)].clone()  # the next replay overwrites the static output

    def capture_all(self) -> None:
        """Every size captured, largest first (they share one memory pool, as vLLM's), and each
        proven against its step run directly. Raises where a capture fails or a replay differs:
        the runner then runs without graphs."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            step = self.steps[size]
            step.fill([])  # every row on the spare slot
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # allocations and lazy initialisation before the capture
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = step()
            self.graphs[size] = (graph, out)
            self._prove(size)
        torch.cuda.synchronize()

    def _prove(self, size: int) -> None:
        """The graph replayed on inputs other than its capture's, against the step run directly."""
        step, (graph, out) = self.steps[size], self.graphs[size]
        spare = step.spare
        # Every row on the spare slot at positions 0.., ids 1..: what the capture did not see.
        step.inputs.copy_(
            torch.stack(
                (
                    torch.arange(1, size + 1),
                    torch.arange(size),
                    torch.full((size,), spare),
                )
            ).to(step.inputs.device)
        )
        graph.replay()
        replayed = out.clone()
        direct = step()
        # cuBLAS may pick another kernel outside a capture: the same choices and rounding's
        # distance pass; a baked-in id, position or slot moves every logit.
        same = torch.equal(replayed.argmax(-1), direct.argmax(-1))
        if not (same and torch.allclose(replayed.float(), direct.float(), rtol=2e-2, atol=2e-2)):
            gap = (replayed.float() - direct.float()).abs().max().item()
            raise RuntimeError(f"the {size}-row graph's replay differs from its step run directly (by {gap:.3g})")


def most_rows(max_running: int) -> int:
    """The most rows a graph covers under `max_running`: the largest size not above it."""
    return max(size for size in ROW_SIZES if size <= max_running)
