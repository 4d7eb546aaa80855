"""A small step in one kernel call: up to 16 tokens, 64 on AMX tiles (a single user's decode
token, the short rest of a prompt that a cached prefix leaves, a few users decoding together,
or these at once) through every layer of a Llama-family model, its final norm and its output
head for each row's last token (C: `smallstep.c` and `amx.c`, built with preheat's other CPU
kernels, preheat.workers.engine.cpukernels), in bfloat16 where the CPU has AVX512-BF16; in
float32 where it has AVX2 and FMA (`smallstep_f32.c`: a host without fast bfloat16, where
`PREHEAT_DTYPE=auto` is float32).

**Why our own code for this step.** A single user's decode step reads every weight once for
one token: its floor is the weights' bytes over the memory's bandwidth (10.1 ms for the real
SmolLM2-135M in bf16 on 2 Zen 4 cores, `preheat bench limit`). transformers' modeling code,
compiled whole (preheat.workers.engine.compiled), ran it at 13.4-15 ms: 241 ops dispatched
from Python (7 products and an attention a layer), and between two of them the second
OpenMP thread, idle longer than libgomp spins, fell asleep, so the next op waited 35-40 µs
for it. A user's turn of 8 tokens after a cached system prompt took 38 ms through oneDNN's
products. llama.cpp runs a step as one graph on a thread pool whose phases meet at barriers;
so does this: one parallel region, the threads splitting each product's rows (each row read
once for every token; past 8 tokens two rows at a time, so the products and not the loads
set the pace), six barriers a layer, the GIL released for the whole step. Each token carries
its own slot, column and position, so a chunk's tokens and different rows' tokens are alike.
Where the CPU has AMX (and Linux grants this process its tile data), the products run on its
tiles instead (`amx.c`: 16 weight rows against every token of the step in one instruction),
so a step of 16 tokens costs little more than one. Rows under LoRA adapters run here too:
each token's own adapter's shrink (A x), computed on every thread (small work, and no barrier
to wait at), and its expand, split over the threads before each product (on tiles, computed
where each block of sums is rounded), its delta added to the product's rounded value and
rounded again, as `preheat::packed_linear_lora` does in the graph.

**transformers is the ground truth.** Each op rounds to bf16 where transformers' eager bf16
op rounds (the norms, the rotation, each product, the residual sums), so its tokens are
eager transformers' up to the order of float32 sums (tests/workers/engine/test_smallstep.py).
It runs only where it was proven to be the model it computes: a Llama or Mistral decoder
(their layer classes), SiLU, no bias, no sliding window, a rotary embedding of fixed
frequencies, every weight bf16 of the expected shape. In float32 every op is transformers'
float32 op (nothing to round), its tokens transformers' up to the order of the sums, and it
takes no adapters. Anything else (another dtype, adapters' stacks not in bf16, more tokens,
another architecture) runs the compiled graph, and
`SmallStepKernel.of` says why.
"""

from __future__ import annotations

import torch

from preheat.workers.engine import cpukernels
from preheat.workers.engine.raggedkv import RaggedKV, Segment

MOST_TOKENS = 16  # smallstep.c's with dot products: a step feeding more runs the compiled graph
MOST_TILE_TOKENS = 64  # with AMX tiles (amx.c): four groups of 16 tokens against each block of rows
MOST_F32_TOKENS = 64  # smallstep_f32.c's: blocks of 4 rows by 3 tokens keep pace with oneDNN's packed products
LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer"}  # transformers' classes whose forward the kernel computes
STATIC_ROPE = {"default", "linear", "llama3"}  # rotary embeddings whose frequencies do not change with the length
# What LoRA adapters may adapt, in smallstep.c's order (LQ ... LDOWN): indices into WEIGHTS.
ADAPTED = (1, 2, 3, 4, 6, 7, 8)
# The order of a layer's row of addresses (smallstep.c's enum).
WEIGHTS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


class SmallStepKernel:
    """The small step of one resident model. Holds its weights (so the addresses it
    passes stay valid) and the last batch's KV buffers it was given."""

    def __init__(self, model, weights: list[list[torch.Tensor]], sizes: dict, eps: float, scale: float) -> None:
        inner = model.model
        self.dtype = inner.embed_tokens.weight.dtype
        self.kit = cpukernels.small_step_kit(self.dtype)
        self.embed, self.norm, self.head = inner.embed_tokens.weight, inner.norm.weight, model.lm_head.weight
        self.inv_freq = inner.rotary_emb.inv_freq.detach().float().contiguous()
        self.rope_scaling = float(inner.rotary_emb.attention_scaling)
        self.weights, self.sizes, self.eps, self.scale = weights, sizes, eps, scale
        self.table = torch.zeros((len(weights), len(WEIGHTS) + 2), dtype=torch.int64)
        self._shapes = [tuple(tensor.shape) for layer in weights for tensor in layer]
        self._pointed_at = (0, 0)  # where the table's weights were: their first and last (`point`)
        self.point()
        self._buffers: list[torch.Tensor] = []  # the keys and values whose addresses the table holds
        # Each weight's kind as the adapters' stacks name it ("model.layers.*.self_attn.q_proj").
        first = next(name for name, module in model.named_modules() if module is inner.layers[0])
        self.kinds = [f"{first.rsplit('.', 1)[0]}.*.{path}" for path in WEIGHTS]
        self._like = torch.empty((1, sizes["kv_heads"], 1, sizes["head_dim"]), dtype=self.dtype)
        # Its products on AMX tiles where the CPU has them and the sizes fit (amx.c); else one
        # AVX-512 bf16 dot product a row, token and 32 inputs (float32: AVX2's, 8 inputs).
        self.tiles = self.dtype is torch.bfloat16 and cpukernels.amx_ready() and tiles_fit(sizes)

    @classmethod
    def of(cls, model) -> tuple[SmallStepKernel | None, str | None]:
        """The kernel of `model`, or (None, why it does not compute it)."""
        config, inner = model.config, getattr(model, "model", None)
        dtype = getattr(getattr(inner, "embed_tokens", None), "weight", torch.empty(0)).dtype
        if (kit := cpukernels.small_step_kit(dtype)) is None:
            return None, f"a {dtype} model (the kernels compute bfloat16 or float32)"
        layers = list(getattr(inner, "layers", []))
        if not layers or any(type(layer).__name__ not in LAYERS for layer in layers):
            return None, f"{config.model_type} layers are not a Llama-family decoder's"
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if getattr(config, "hidden_act", None) != "silu" or rope not in STATIC_ROPE:
            return None, f"activation {config.hidden_act!r} or rotary embedding {rope!r} is not computed"
        if getattr(config, "sliding_window", None) is not None or len(layers) != config.num_hidden_layers:
            return None, "a sliding window, or layers the config does not count"
        attention = layers[0].self_attn
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        dim, hidden = attention.head_dim, config.hidden_size
        if dim % 32 or dim > 256 or heads % kv_heads:
            return None, f"head size {dim} (a multiple of 32, at most 256) or {heads}/{kv_heads} heads"
        inter, vocab = config.intermediate_size, model.lm_head.weight.shape[0]
        shapes = [(hidden,), (heads * dim, hidden), (kv_heads * dim, hidden), (kv_heads * dim, hidden)]
        shapes += [(hidden, heads * dim), (hidden,), (inter, hidden), (inter, hidden), (hidden, inter)]
        weights = []
        for layer in layers:
            modules = [layer.get_submodule(path) for path in WEIGHTS]
            if any(getattr(module, "bias", None) is not None for module in modules):
                return None, "a layer with a bias"
            weights.append([module.weight for module in modules])  # the parameters: see `point`
        eps = {float(layer.get_submodule(path).variance_epsilon) for layer in layers for path in WEIGHTS[::5]}
        scale = {float(layer.self_attn.scaling) for layer in layers}
        ends = [inner.embed_tokens.weight, inner.norm.weight, model.lm_head.weight]
        if not all(_held(t, shape, dtype) for ts in weights for t, shape in zip(ts, shapes, strict=True)) or not all(
            _held(t, shape, dtype) for t, shape in zip(ends, [(vocab, hidden), (hidden,), (vocab, hidden)], strict=True)
        ):
            return None, f"weights that are not all {dtype}, contiguous and of the config's shapes"
        if len(eps) != 1 or len(scale) != 1 or float(inner.norm.variance_epsilon) not in eps:
            return None, "norms or attention scales that differ from layer to layer"
        if inner.rotary_emb.inv_freq.shape != (dim // 2,):
            return None, "a rotary embedding over part of the head"
        if not cpukernels.available(kit):
            return None, f"preheat's {kit.module} kernels do not run here ({cpukernels.why_not_built(kit)})"
        sizes = {"layers": len(layers), "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": dim}
        sizes |= {"intermediate": inter, "vocab": vocab}
        return cls(model, weights, sizes, eps.pop(), scale.pop()), None

    @property
    def adapts(self) -> bool:
        """Whether it computes rows under LoRA adapters (bf16 stacks): the bf16 kernel does."""
        return self.dtype is torch.bfloat16

    @property
    def most_tokens(self) -> int:
        """The most ids a step it runs may feed: more on tiles, whose products cost little more
        for 64 tokens than for one, and in float32, whose products sum blocks of rows and tokens."""
        if self.dtype is torch.float32:
            return MOST_F32_TOKENS
        return MOST_TILE_TOKENS if self.tiles else MOST_TOKENS

    def covers(self, segments: list[Segment]) -> bool:
        """Whether a step of these segments feeds at most `most_tokens` ids in all."""
        return sum(len(segment.ids) for segment in segments) <= self.most_tokens

    def __call__(self, kv: RaggedKV, segments: list[Segment], adapters=None) -> torch.Tensor:
        """The logits after each segment's last id, [segments, vocab] in the model's dtype; their keys and
        values written into their slots (the step's layout set on `kv`, as a step's pass sets it).
        `adapters`: (the step's stacks, each token's columns) where its rows have LoRA adapters
        (preheat.workers.engine.lorastack), each token's added to every product it adapts."""
        if self._pointed_at != (self.weights[0][1].data_ptr(), self.weights[-1][-1].data_ptr()):
            self.point()  # a level-1 sleep's wake gave every parameter new storage
        tokens = sum(len(segment.ids) for segment in segments)
        stacks, width, columns = self._adapters(*adapters, tokens) if adapters is not None else (None, 0, None)
        where, keep = kv.small_step(segments, self._like)
        held = [tensor for pair in kv.buffers for tensor in pair]
        if len(held) != len(self._buffers) or any(a is not b for a, b in zip(held, self._buffers, strict=True)):
            shape = (*kv.capacity[:1], self.sizes["kv_heads"], kv.capacity[1], self.sizes["head_dim"])
            if not all(_held(tensor, shape, self.dtype) for tensor in held):
                raise ValueError(f"the small step takes {self.dtype} KV buffers of {shape}, got {_described(held)}")
            self.table[:, len(WEIGHTS) :] = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in kv.buffers])
            self._buffers = held
        logits = torch.empty((len(keep), self.sizes["vocab"]), dtype=self.dtype)
        ids = torch.tensor([i for segment in segments for i in segment.ids], dtype=torch.int64)
        where, keep = torch.tensor(where, dtype=torch.int64), torch.tensor(keep, dtype=torch.int64)
        z, (slots, capacity) = self.sizes, kv.capacity
        cpukernels.small_step(
            self.kit, self.table.data_ptr(), self.embed.data_ptr(), self.norm.data_ptr(), self.head.data_ptr(),
            self.inv_freq.data_ptr(), logits.data_ptr(), ids.data_ptr(), where.data_ptr(), ids.shape[0],
            keep.data_ptr(), keep.shape[0], z["layers"], z["hidden"], z["heads"], z["kv_heads"], z["head_dim"],
            z["intermediate"], z["vocab"], slots, capacity, self.eps, self.scale, self.rope_scaling,
            0 if stacks is None else stacks.data_ptr(), width, 0 if columns is None else columns.data_ptr(),
            self.tiles,
        )  # fmt: skip
        return logits

    def point(self) -> None:
        """The table at the layers' weights where they are now. It holds the parameters, not
        their storage: a level-1 sleep swaps every parameter's data for nothing (and its wake
        for what it reads back), so the storage it frees is not kept alive here; the move into
        huge pages (hugepages.py) swaps them a piece at a time and calls this after each."""
        tensors = [tensor for layer in self.weights for tensor in layer]
        if not all(_held(tensor, shape, self.dtype) for tensor, shape in zip(tensors, self._shapes, strict=True)):
            raise ValueError(
                f"the small step reads the {self.dtype} weights it was built on, got {_described(tensors)}"
            )
        for layer, tensors in enumerate(self.weights):
            self.table[layer, : len(WEIGHTS)] = torch.tensor([t.data_ptr() for t in tensors])
        self._pointed_at = (self.weights[0][1].data_ptr(), self.weights[-1][-1].data_ptr())

    def _adapters(self, stacked, columns: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """The step's stacks as smallstep.c reads them: [kinds, 2] addresses of each adapted
        kind's A and B (0 where none adapts it), their width, the columns (a row for each of
        the step's `tokens`: the kernel reads that many); each proven first."""
        if not self.adapts:
            raise ValueError(f"the small step computes no adapters on a {self.dtype} model")
        width, layers = None, self.sizes["layers"]
        stacks = torch.zeros((len(ADAPTED), 2), dtype=torch.int64)
        for k, index in enumerate(ADAPTED):
            kind = self.kinds[index]
            if kind not in stacked.a:
                continue
            a, b = stacked.a[kind], stacked.b[kind]
            out, inner = self.weights[0][index].shape
            width = a.shape[1] if width is None else width
            if not (
                _held(a, (layers, width, inner), torch.bfloat16) and _held(b, (layers, width, out), torch.bfloat16)
            ):
                raise ValueError(
                    f"the small step takes bf16 stacks of {kind} like its weights, got {_described([a, b])}"
                )
            stacks[k] = torch.tensor([a.data_ptr(), b.data_ptr()])
        if columns.dtype is not torch.int64 or columns.shape != (tokens, 2) or not columns.is_contiguous():
            raise ValueError(f"the small step takes [{tokens}, 2] int64 adapter columns, got {_described([columns])}")
        return stacks, width or 0, columns


def tiles_fit(sizes: dict) -> bool:
    """Whether AMX tiles (16 rows of a product, 32 of its inputs) cover every layer's products
    whole: each product's inputs a multiple of 32, its rows of 16 (smallstep.c proves it again).
    The output head's rows past the last 16 run as dot products."""
    inputs = (sizes["hidden"], sizes["heads"] * sizes["head_dim"], sizes["intermediate"])
    return all(n % 32 == 0 for n in inputs) and (sizes["kv_heads"] * sizes["head_dim"]) % 16 == 0


def _held(tensor: torch.Tensor, shape: tuple, dtype: torch.dtype) -> bool:
    """Whether `tensor` is what the kernel reads by its address: `dtype`, on the CPU, contiguous, `shape`."""
    return tensor.dtype is dtype and tensor.is_cpu and tensor.is_contiguous() and tuple(tensor.shape) == shape


def _described(tensors: list[torch.Tensor]) -> str:
    return ", ".join(sorted({f"{tuple(t.shape)} {t.dtype}" for t in tensors}))
