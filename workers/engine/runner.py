"""The model runner: the one place a model runs (vLLM's `GPUModelRunner`, on every device).

The scheduler decides what a step feeds (which rows decode, which pre-fill chunks join);
the runner runs it: the step's one forward pass over the running rows' packed ids
(`step`), a prompt or a lone request's pass (`forward`), and the choice of each row's next
token (`sample`). It owns the model, the step's input buffers and, where compiled
(`preheat.workers.engine.compiled`), the graphs each step runs as. A step the graphs do
not cover runs eager, through transformers' own modeling code with preheat's ragged
attention; compiled or eager, a step gives the same tokens (tests/workers/engine).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from preheat.workers.engine import attention, compilestore, cudagraphs, lora
from preheat.workers.engine.compiled import CompiledSteps, CompileReport, GraphRefused, error_line, why_not_compiled
from preheat.workers.engine.device import Placement, out_of_memory_as_error
from preheat.workers.engine.hugepages import HugePageWeights
from preheat.workers.engine.raggedkv import RaggedKV, Segment, batchable

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ModelRunner:
    """Runs one resident model. Only the scheduler's thread calls it."""

    name: str
    model: object  # a transformers PreTrainedModel, in inference mode
    placement: Placement
    cache_kwarg: str = "past_key_values"  # transformers 5.24 renamed it `cache`
    compiled: object | None = None  # preheat.workers.engine.compiled.CompiledSteps, once compiled
    compile_report: object | None = None  # what its latest compile did (compiled.CompileReport)
    decode_graphs: object | None = None  # cudagraphs.DecodeGraphs: on CUDA, its decode steps captured
    limits: object | None = None  # the batch's BatchLimits its graphs were sized by
    spare_kv: tuple | None = None  # (buffers, capacity) of the last batch whose rows all left: the next one's
    weight_pages: HugePageWeights | None = None  # its weights moving into huge pages while idle (hugepages.py)

    # Passes ---------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, cache=None, adapter=None):
        """One forward pass extending `cache` (a new DynamicCache when None): a prefix's
        pre-fill, a lone request's chunk or token, under `adapter` (a LoraWeights) if given.
        Returns (the last position's logits, cache)."""
        from transformers import DynamicCache

        cache = cache if cache is not None else DynamicCache(config=self.model.config)
        device = self.placement.device
        doing = f"running {input_ids.shape[-1]} tokens through {self.name} (after {cache.get_seq_length()} cached)"

        rows = lora.token_rows([input_ids.shape[-1]], [adapter], device) if adapter is not None else []

        def run():
            with torch.inference_mode(), lora.applied(self.model, rows):
                return self.model(
                    input_ids=input_ids.to(device, non_blocking=True),
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.cache_kwarg: cache},
                ).logits[0, -1]

        return out_of_memory_as_error(device, doing, run), cache

    def step(self, kv: RaggedKV, segments: list[Segment], adapters: Sequence | None = None) -> torch.Tensor:
        """The step's one forward pass over the running rows: the logits after each segment's
        last id, [segments, vocab]. Each segment's tokens under its adapter (`adapters`, one
        LoraWeights or None per segment): rows of several adapters and of the base in one
        pass. Through a compiled graph where one covers the step (with adapters too where the
        model's adapter steps are compiled)."""
        fed = sum(len(segment.ids) for segment in segments)
        doing = f"running {len(segments)} requests together on {self.name} ({fed} ids)"
        adapted = adapters is not None and any(adapter is not None for adapter in adapters)
        if self.decode_graphs is not None and self.decode_graphs.covers(kv, segments, adapters):
            return out_of_memory_as_error(self.placement.device, doing, lambda: self.decode_graphs.run(kv, segments))
        if self.compiled is not None and (graph := self.compiled.for_step(kv, segments, adapters)) is not None:
            try:
                return out_of_memory_as_error(self.placement.device, doing, lambda: graph(kv, segments))
            except GraphRefused:
                pass  # eager below, as any step no graph covers
        lengths = [len(segment.ids) for segment in segments]
        rows = lora.token_rows(lengths, list(adapters), self.placement.device) if adapted else []

        def run():
            with torch.inference_mode(), attention.running(kv), lora.applied(self.model, rows):
                return self.model(**kv.step_inputs(segments), use_cache=False).logits[0]

        return out_of_memory_as_error(self.placement.device, doing, run)

    # Compiled steps -------------------------------------------------------------------

    def compile(self, mode: str, store, model_digest: str, adapters: bool = False, limits=None):
        """Compile the steps (or restore them from `store`, a CompileStore, or None), before
        the model takes requests; with `adapters` (the model declares LoRA adapters), its
        steps with adapter rows too; on CUDA, its decode steps captured as graphs sized by
        `limits` (the scheduler's BatchLimits). Never raises: what cannot be compiled runs
        eager, and the report says why (logged once). Its weights move into huge pages while idle after it."""
        if self.weight_pages is None:
            self.weight_pages = HugePageWeights.of(self.name, self.model, self.placement.device)
        if self.compiled is not None:
            if not self.compiled.ready:  # a level-1 sleep kept the graphs
                self.compiled.resume()
                self.compile_report = CompileReport("kept", self._capture(self.limits))
                log.info(
                    "model %s: steps kept through the sleep, ready again in %.0f ms",
                    self.name,
                    self.compile_report.ms,
                )
            return self.compile_report
        reason = "PREHEAT_COMPILE=off" if mode == "off" else why_not_compiled(self.placement.device)
        scratch = self.new_batch()
        if reason is None and scratch is None:
            reason = "its cache or attention cannot run rows together, so no step of it is compiled"
        if reason is not None:
            if mode != "off":
                log.warning("model %s runs its steps eager: %s", self.name, reason)
            self.compile_report = CompileReport("eager", reason=reason)
            return self.compile_report
        buckets = "one,many/1" + ("+lora" if adapters else "")
        key = compilestore.identity(self.placement.device, self.placement.dtype, model_digest, buckets, self.name)
        compilestore.probed()
        before = compilestore.snapshot()
        if store is not None:
            store.restore(key)
        restored = compilestore.snapshot()
        folder = compilestore.graphs_folder(key)
        steps = CompiledSteps(self.name, self.model, self.placement.device, adapters=adapters, folder=folder)
        try:
            ms = steps.compile(scratch)
        except Exception as exc:
            reason = f"compiling failed ({error_line(exc)})"
            log.warning("model %s runs its steps eager: %s", self.name, reason)
            self.compile_report = CompileReport("eager", reason=reason)
            return self.compile_report
        self.compiled = steps
        ms += self._capture(limits)
        made = steps.made
        # What the entry lacked was made here: a graph (compiled), or kernels a loaded graph
        # calls (stored by a process whose compile named them otherwise, built as it loaded).
        # The entry is stored again with them, or every start would make them again.
        built = len(compilestore.libraries(compilestore.snapshot() - restored))
        if store is not None and (made["compiled"] or built):
            store.publish(key, before)
        source = "compiled" if made["compiled"] else "restored"
        self.compile_report = CompileReport(source, ms, kernels_built=built)
        log.info(
            "model %s: steps %s in %.0f ms (graphs: %d compiled, %d loaded; kernels: %d built)",
            self.name,
            source,
            ms,
            made["compiled"],
            made["loaded"],
            built,
        )
        return self.compile_report

    def _capture(self, limits) -> float:
        """On CUDA, the decode steps captured as graphs (preheat.workers.engine.cudagraphs) over
        KV buffers kept for the model's life; returns the milliseconds it took. Where they
        cannot be, decode steps run as any other step, said once."""
        self.decode_graphs, self.limits = None, limits
        if self.placement.device.type != "cuda" or limits is None:
            return 0.0
        started = time.perf_counter()
        try:
            self.decode_graphs = self.static_decode(limits)
            self.decode_graphs.capture_all()
        except Exception as exc:  # a capture or its proof: the steps run uncaptured
            self.decode_graphs = None
            log.warning("model %s decodes without CUDA graphs: %s", self.name, error_line(exc))
            return 0.0
        log.info(
            "model %s: decode steps of %s rows captured as CUDA graphs",
            self.name,
            ",".join(map(str, self.decode_graphs.sizes)),
        )
        return (time.perf_counter() - started) * 1000

    def static_decode(self, limits) -> cudagraphs.DecodeGraphs:
        """The decode steps over static buffers, for as many rows as `limits` run (at most
        the largest captured size) and as many columns as their KV budget gives each row; run
        directly until captured as CUDA graphs (`capture_all`)."""
        from transformers import DynamicCache

        kv = RaggedKV(DynamicCache(config=self.model.config), self.placement.device)
        if (why := cudagraphs.DecodeGraphs.why_not(kv)) is not None:
            raise ValueError(why)
        rows = cudagraphs.most_rows(limits.max_running)
        kv.add(None, 1)
        self.step(kv, [Segment(0, 0, (0,))])  # every layer's buffers made: one position of one slot
        per_position = kv.nbytes
        longest = max_context(self.model.config) or 4096
        kv.reserve(rows + 1, max(2, min(longest, limits.running_kv_bytes // ((rows + 1) * per_position))))
        return cudagraphs.DecodeGraphs(self.model, (kv.buffers, kv.capacity), rows)

    def adapter_resident(self, adapter) -> None:
        """`adapter` (a LoraWeights) was read: stacked for the compiled steps now, so the first
        step that needs it does not pay for it."""
        if self.compiled is not None and self.compiled.stack is not None:
            self.compiled.stack.admit(adapter)

    def idle_work(self):
        """What this model wants done while no request waits or runs, one piece a call (a
        callable returning whether more is left), or None: its weights moved into huge pages,
        then packed for oneDNN."""
        return self._idle_piece if self._moving() or self._unpacked() else None

    def _idle_piece(self) -> bool:
        if self._moving():
            self.weight_pages.move_next()
            if self.compiled is not None and self.compiled.small_step is not None:
                self.compiled.small_step.point()  # its table names the weights' storage
        elif self._unpacked():
            self.compiled.pack_next()
        return self._moving() or self._unpacked()

    def _moving(self) -> bool:
        return self.weight_pages is not None and self.weight_pages.left()

    def _unpacked(self) -> bool:
        return self.compiled is not None and bool(self.compiled.unpacked())

    def suspend(self) -> None:
        """A level-1 sleep: the packed weights freed, the graphs kept (`compile` resumes them);
        CUDA graphs, which name the weights' addresses, let go (captured again on the wake)."""
        self.decode_graphs = self.spare_kv = self.weight_pages = None  # moved again after the wake
        if self.compiled is not None:
            self.compiled.suspend()

    def release(self) -> None:
        """The compiled steps let go (their packed weights with them): a level-2 sleep."""
        if self.compiled is not None:
            self.compiled.release()
        self.compiled = self.compile_report = self.decode_graphs = self.spare_kv = self.weight_pages = None

    # The running rows' KV ---------------------------------------------------------------

    def new_batch(self) -> RaggedKV | None:
        """The KV of a batch of running rows, or None where this model cannot run rows
        together (its cache's layers, or an attention the rows' pass cannot run)."""
        from transformers import DynamicCache

        shell = DynamicCache(config=self.model.config)
        if not (batchable(shell) and self.model.config._attn_implementation == attention.NAME):
            return None
        kv = RaggedKV(shell, self.placement.device)
        if self.decode_graphs is not None:  # the buffers its graphs read
            kv.adopt(*self.decode_graphs.reserved)
        elif self.spare_kv is not None:  # the last batch's, as large as its rows needed
            kv.adopt(*self.spare_kv)
            self.spare_kv = None
        return kv

    def keep_batch_kv(self, kv: RaggedKV) -> None:
        """A batch's rows all left: its KV buffers are kept for the next batch (`new_batch`),
        which would make them again, each of their pages faulted in and zeroed (5-52 ms of a
        first request after a pause, on a 2-core Zen 3 VM). A sleep frees them."""
        if self.decode_graphs is None and kv.buffers and all(pair is not None for pair in kv.buffers):
            self.spare_kv = (kv.buffers, kv.capacity)

    # Sampling ---------------------------------------------------------------------------

    @staticmethod
    def sample(requests: Sequence, logits: torch.Tensor) -> list:
        """Each request's next token from its row of `logits` ([rows, vocab]), by its own
        sampler: (token, log probability or None) per row, or the exception its sampler raised.
        Greedy rows with nothing to apply are chosen together, in one argmax."""
        chosen: list = [None] * len(requests)
        plain = [i for i, request in enumerate(requests) if request.sampler.plain_greedy]
        if plain:
            # max's indices are argmax's (the first of equal values) at a quarter of its time on
            # bf16 rows here (47 against 186 µs a 49,152-token row), every row's once.
            rows = logits if len(plain) == len(requests) else logits[plain]
            for i, token in zip(plain, rows.max(-1).indices.tolist(), strict=True):
                chosen[i] = (token, None)
        for i, request in enumerate(requests):
            if chosen[i] is None:
                try:
                    chosen[i] = request.sampler.choose(logits[i], request.ids)
                except Exception as exc:  # the request's own: it ends with it, the others go on
                    chosen[i] = exc
        return chosen


def max_context(config) -> int:
    """The longest context a model's config declares, 0 where it names none (GPT-2's call it n_positions)."""
    return int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 0)
