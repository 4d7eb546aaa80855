"""Continuous batching: many requests decoded together, each from its own cached prefix.

One thread per process runs every forward pass: the scheduler. Callers (HTTP handlers,
Celery pool threads) hand it requests and read their tokens from a queue; nothing else
touches the model while it runs. Each iteration of its loop:

1. runs one queued *call* (a template's pre-fill, a warmup's probe, a first-call
   exercise): work that is not a request is scheduled with the traffic, one piece per
   iteration, so decoding goes on between the pieces;
2. admits waiting requests while a model's batch has a free row and the iteration's
   prompt-token budget lasts: each starts from the longest cached prefix of its ids
   (``PrefixEngine.start``: the entry is held only while it is read), computes its own
   remaining ids, and chooses its first token;
3. runs one decode step per model: a single forward pass feeds every running row its
   next token (``workers.batchkv``), then each row's own sampler chooses from its own
   logits, with its own penalties, seed, stop ids and ``max_tokens``.

A request leaves its row when it finishes, when its stream is closed (a stop string, a
client gone: ``TextStream`` closes the token iterator), or when it fails: a failure in its
own pre-fill or sampling ends that request only; a decode step that fails for the batch
(out of memory) is undone, and the newest row leaves with the error while the others go
on. A full queue refuses at once (``QueueFullError``: HTTP 429 with Retry-After).
"""

from __future__ import annotations

import atexit
import logging
import math
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from preheat.errors import PreheatError
from workers.batchkv import BatchKV, batchable
from workers.device import out_of_memory_as_error
from workers.generate import Completion, PrefixEngine, Start, TextStream, ms_since, stop_token_ids
from workers.prefix import Prefix, check_context, clone_for_request, forward, truncatable
from workers.resident import ResidentModel
from workers.sampling import ModelDefaults, Sampler, SamplingParams, sampler_for

log = logging.getLogger(__name__)

_END = object()


class QueueFullError(PreheatError):
    """More requests wait than the engine queues: the caller should come back later."""

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(
            f"{waiting} requests are already waiting (PREHEAT_MAX_QUEUED_REQUESTS); retry in {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class BatchLimits:
    max_running: int = 16  # rows decoding together, per model
    max_queued: int = 64  # requests waiting for a row; one more is refused
    prefill_tokens_per_step: int = 512  # prompt tokens computed between two decode steps

    def __post_init__(self) -> None:
        for name in ("max_running", "max_queued", "prefill_tokens_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(eq=False)
class _Row:
    """One request, from its submission to its last token."""

    resident: ResidentModel
    prompt_ids: torch.Tensor
    sampling: SamplingParams
    completion: Completion
    use_cache: bool
    record: bool
    remember: bool
    started: float
    on_first_token: Callable[[Completion], None] | None
    ids: list[int] = field(default_factory=list)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: bool = False
    sampler: Sampler | None = None
    prompt_only: Prefix | None = None  # the prompt's KV, where the answer's cannot be cut (see _remember)
    last_logits: torch.Tensor | None = None
    stops: frozenset[int] = frozenset()

    @property
    def generated(self) -> int:
        return len(self.ids) - self.completion.prompt_tokens


@dataclass
class _Batch:
    kv: BatchKV
    rows: list[_Row] = field(default_factory=list)


@dataclass(eq=False)
class _Prefilling:
    """A request whose prompt is longer than one iteration's budget: computed a chunk an
    iteration, with decode steps for the others in between."""

    row: _Row
    kv: object
    feed: torch.Tensor  # the ids still to compute, [1, n]


@dataclass(eq=False)
class _Call:
    work: Callable[[], object]
    finished: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class Scheduler:
    def __init__(self, engine: PrefixEngine, limits: BatchLimits = BatchLimits()) -> None:
        self.engine, self.limits = engine, limits
        self._waiting: deque[_Row] = deque()
        self._calls: deque[_Call] = deque()
        self._batches: dict[str, _Batch] = {}
        self._prefilling: list[_Prefilling] = []
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._request_s = 1.0  # a moving average of how long a request runs, for Retry-After
        self.steps = 0  # decode steps run, and rows they fed: the mean batch size is their ratio
        self.rows_stepped = 0

    # What callers use -----------------------------------------------------------------

    def submit(
        self,
        resident: ResidentModel,
        prompt_ids: torch.Tensor,
        sampling: SamplingParams,
        *,
        use_cache: bool = True,
        record: bool = True,
        remember: bool = False,
        started: float | None = None,
        on_first_token: Callable[[Completion], None] | None = None,
    ) -> TextStream:
        """Queue a request; iterate the stream for its pieces as the batch decodes them."""
        check_context(resident, prompt_ids.shape[-1], "prompt", new_tokens=sampling.max_tokens)
        row = _Row(
            resident,
            prompt_ids,
            sampling,
            Completion(resident.name, int(prompt_ids.shape[-1]), 0),
            use_cache,
            record,
            remember,
            started if started is not None else time.perf_counter(),
            on_first_token,
            ids=prompt_ids[0].tolist(),
        )
        with self._wakeup:
            if len(self._waiting) >= self.limits.max_queued:
                raise QueueFullError(len(self._waiting), self._retry_after_s())
            self._waiting.append(row)
            self._start_thread()
            self._wakeup.notify()
        return TextStream(resident, row.completion, self._tokens(row), sampling.stop)

    def call(self, work: Callable[..., object], *args, **kwargs):
        """Run `work` on the scheduler's thread between two steps, and return what it returns."""
        if threading.current_thread() is self._thread:
            return work(*args, **kwargs)
        job = _Call(lambda: work(*args, **kwargs))
        with self._wakeup:
            self._calls.append(job)
            self._start_thread()
            self._wakeup.notify()
        job.finished.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def load(self) -> dict[str, int]:
        """Requests running and waiting now (metrics, `preheat workers`)."""
        with self._wakeup:
            running = sum(len(batch.rows) for batch in list(self._batches.values())) + len(self._prefilling)
            return {"running": running, "waiting": len(self._waiting), "max_running": self.limits.max_running}

    def cancel_all(self) -> None:
        """Every request taken ends at the next step (the process is exiting)."""
        with self._wakeup:
            rows = [*self._waiting, *(p.row for p in self._prefilling)]
            rows += [row for batch in list(self._batches.values()) for row in batch.rows]
            for row in rows:
                row.cancelled.set()
            self._wakeup.notify()

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what was taken (up to `timeout_s`) and stop the thread; new work starts it again."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        with self._wakeup:
            if self._thread is thread and not (thread and thread.is_alive()):
                self._thread, self._stopping = None, False

    # The loop -------------------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._thread is None:
            _RUNNING.add(self)
            self._thread = threading.Thread(target=self._run, name="preheat-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not (self._calls or self._waiting or self._batches or self._prefilling or self._stopping):
                    self._wakeup.wait()
                if self._stopping and not (self._calls or self._waiting or self._batches or self._prefilling):
                    return
                call = self._calls.popleft() if self._calls else None
            if call is not None:
                self._run_call(call)
            self._admit()
            for model in list(self._batches):
                self._step(model)

    @staticmethod
    def _run_call(call: _Call) -> None:
        try:
            call.result = call.work()
        except BaseException as exc:  # handed to the caller, who raises it
            call.error = exc
        finally:
            call.finished.set()

    def _next_admissible(self, taken: dict[str, int]) -> _Row | None:
        """The first waiting request whose model has a free row (`taken`: rows given out in
        this iteration, not yet in the batch)."""
        with self._wakeup:
            for row in self._waiting:
                batch = self._batches.get(row.resident.name)
                running = (len(batch.rows) if batch else 0) + taken.get(row.resident.name, 0)
                if row.cancelled.is_set() or running < self.limits.max_running:
                    self._waiting.remove(row)
                    return row
        return None

    def _admit(self) -> None:
        """Waiting requests join, up to the iteration's prompt-token budget. Those of one
        model that start from a cache that can be cut (or none) are pre-filled together,
        in one forward pass; the others (a prompt that is a cached entry, a window past its
        size) one by one. Each holds its cached entry only until its KV is in the batch."""
        budget = self._continue_prefills(self.limits.prefill_tokens_per_step)
        taken: dict[str, int] = {}
        for prefilling in self._prefilling:
            taken[prefilling.row.resident.name] = taken.get(prefilling.row.resident.name, 0) + 1
        groups: dict[str, list[tuple[_Row, Start]]] = {}
        with ExitStack() as held:
            while budget > 0 and (row := self._next_admissible(taken)) is not None:
                if row.cancelled.is_set():
                    self._finish(row, None)
                    continue
                try:
                    start = held.enter_context(self._begin(row))
                except Exception as exc:
                    self._fail(row, exc)
                    continue
                taken[row.resident.name] = taken.get(row.resident.name, 0) + 1
                budget -= max(1, int(start.feed_ids.shape[-1]))
                if start.logits is None and (start.cache is None or _croppable(start.cache)):
                    groups.setdefault(row.resident.name, []).append((row, start))
                else:
                    self._start_alone(row, start)
            for group in groups.values():
                for similar in _by_feed_length(group):
                    if len(similar) > 1 and any(start.cache is not None for _, start in similar):
                        self._prefill_together(similar)
                    else:
                        for row, start in similar:
                            self._start_alone(row, start)

    @contextmanager
    def _begin(self, row: _Row) -> Iterator[Start]:
        resident = row.resident
        row.stops = stop_token_ids(resident)
        row.sampler = sampler_for(
            row.sampling, ModelDefaults.of(resident.model), len(row.ids), resident.placement.device
        )
        with self.engine.start(resident, row.prompt_ids, use_cache=row.use_cache, record=row.record) as start:
            row.completion.cached_tokens = start.cached_tokens
            yield start

    def _start_alone(self, row: _Row, start: Start) -> None:
        """Pre-fill one request from its start and choose its first token; a prompt longer
        than an iteration's budget is computed a chunk an iteration. A failure here is the
        request's alone."""
        try:
            if start.logits is not None:
                self._first_token(row, start.logits, start.cache)
                return
            prefilling = _Prefilling(row, start.cache, start.feed_ids)
            if not self._advance(prefilling, self.limits.prefill_tokens_per_step):
                self._prefilling.append(prefilling)
        except Exception as exc:
            self._fail(row, exc)

    def _continue_prefills(self, budget: int) -> int:
        """Each long prompt under way gets its next chunk, while the budget lasts; returns
        what is left of it."""
        under_way = []
        for prefilling in self._prefilling:
            if prefilling.row.cancelled.is_set():
                self._finish(prefilling.row, None)
            elif budget <= 0:
                under_way.append(prefilling)
            else:
                chunk = min(budget, int(prefilling.feed.shape[-1]))
                budget -= chunk
                try:
                    if not self._advance(prefilling, chunk):
                        under_way.append(prefilling)
                except Exception as exc:
                    self._fail(prefilling.row, exc)
        self._prefilling = under_way
        return budget

    def _advance(self, prefilling: _Prefilling, tokens: int) -> bool:
        """Compute the next `tokens` ids of a prompt; True once its first token is chosen."""
        piece, prefilling.feed = prefilling.feed[:, :tokens], prefilling.feed[:, tokens:]
        logits, prefilling.kv = forward(prefilling.row.resident, piece, prefilling.kv)
        if prefilling.feed.shape[-1]:
            return False
        self._first_token(prefilling.row, logits, prefilling.kv)
        return True

    def _first_token(self, row: _Row, logits: torch.Tensor, kv) -> None:
        if row.remember and not truncatable(kv):
            # Its answer's KV could not be cut back to the prompt: keep the prompt's.
            row.prompt_only = Prefix(clone_for_request(kv), logits)
        if self._choose(row, logits):
            self._finish(row, kv)
        else:
            self._join(row, kv)

    def _prefill_together(self, group: list[tuple[_Row, Start]]) -> None:
        """One forward pass pre-fills every request of `group`. All feed as many ids as the
        longest remaining prompt: a request with fewer left to compute feeds some of its
        cached ids again (its cache cut back to make room), so each row's positions stay
        contiguous (workers.batchkv). If the pass fails, each request is started alone, so
        a failure stays with the request that causes it."""
        resident = group[0][0].resident
        longest = max(int(start.feed_ids.shape[-1]) for _, start in group)
        shell = next(start.cache for _, start in group if start.cache is not None)
        try:
            kv, feeds = BatchKV.like(shell), []
            for row, start in group:
                keep = max(0, len(row.ids) - longest)
                kv.add(_cut(start.cache, keep, start.cached_tokens) if keep else shell, keep)
                feeds.append(row.ids[keep:])
            logits = self._forward_inputs(resident, kv, kv.prefill_inputs(feeds, 0), len(group))
            kv.prefilled(feeds)
        except Exception as exc:
            log.info("pre-filling %d requests together failed (%s): one by one", len(group), exc)
            for row, start in group:
                self._start_alone(row, start)
            return
        rows = [row for row, _ in group]
        for i, row in enumerate(rows):
            if row.remember and not truncatable(own := kv.row(i)):
                row.prompt_only = Prefix(own, logits[i].clone())
        batch = self._batches.get(resident.name)
        if batch is None:
            batch = self._batches[resident.name] = _Batch(kv)
        else:
            batch.kv.merge(kv)
        first = len(batch.rows)
        batch.rows += rows
        self._drop(batch, [first + i for i, row in enumerate(rows) if self._choose_or_fail(row, logits[i])])

    def _join(self, row: _Row, kv) -> None:
        name = row.resident.name
        if not batchable(kv):
            raise PreheatError(f"model {name}'s cache layers cannot be batched; set PREHEAT_ENGINE=sequential")
        batch = self._batches.get(name)
        if batch is None:
            batch = self._batches[name] = _Batch(BatchKV.like(kv))
        batch.kv.add(kv, len(row.ids) - 1)  # every id but the one just chosen, which the next step feeds
        batch.rows.append(row)

    def _step(self, model: str) -> None:
        batch = self._batches[model]
        self._drop(batch, [i for i, row in enumerate(batch.rows) if row.cancelled.is_set()])
        if not batch.rows:
            del self._batches[model]
            return
        resident = batch.rows[0].resident
        before = batch.kv.snapshot()
        try:
            logits = self._forward(resident, batch)
        except Exception as exc:
            # Undone for all; the newest row (the one that made the batch this large) leaves.
            batch.kv.restore(before)
            self._fail(batch.rows[-1], exc)
            self._drop(batch, [len(batch.rows) - 1])
            return
        batch.kv.stepped()
        self.steps, self.rows_stepped = self.steps + 1, self.rows_stepped + len(batch.rows)
        self._drop(batch, [i for i, row in enumerate(batch.rows) if self._choose_or_fail(row, logits[i])])

    @classmethod
    def _forward(cls, resident: ResidentModel, batch: _Batch) -> torch.Tensor:
        inputs = batch.kv.step_inputs([row.ids[-1] for row in batch.rows])
        return cls._forward_inputs(resident, batch.kv, inputs, len(batch.rows))

    @staticmethod
    def _forward_inputs(resident: ResidentModel, kv: BatchKV, inputs: dict, rows: int) -> torch.Tensor:
        """One forward pass over the batch: the next-token logits of every row, [rows, vocab]."""
        doing = f"running {rows} requests together on {resident.name} ({inputs['input_ids'].shape[-1]} ids each)"

        def run():
            with torch.inference_mode():
                return resident.model(
                    **inputs, use_cache=True, logits_to_keep=1, **{resident.cache_kwarg: kv.cache}
                ).logits[:, -1]

        return out_of_memory_as_error(resident.placement.device, doing, run)

    def _drop(self, batch: _Batch, rows: list[int]) -> None:
        """Take `rows` out of the batch; those that did not fail are finished."""
        if not rows:
            return
        for i in rows:
            row = batch.rows[i]
            if not row.done:
                # Its KV is copied out only when it is what stays cached (see _remember).
                wanted = row.remember and row.prompt_only is None
                self._finish(row, batch.kv.row(i) if wanted else None)
        leaving = set(rows)
        keep = [i for i in range(len(batch.rows)) if i not in leaving]
        batch.kv.keep(keep)
        batch.rows = [batch.rows[i] for i in keep]

    # One row's tokens -----------------------------------------------------------------

    def _choose_or_fail(self, row: _Row, logits: torch.Tensor) -> bool:
        """_choose; a failure (its sampler's) ends the row with its error. True: it leaves."""
        try:
            return self._choose(row, logits)
        except Exception as exc:
            self._fail(row, exc)
            return True

    def _choose(self, row: _Row, logits: torch.Tensor) -> bool:
        """The row's next token from its logits, sent to its reader; True when it is its last."""
        token, logprob = row.sampler.choose(logits, row.ids)
        row.ids.append(token)
        row.last_logits = logits
        if row.generated == 1:
            row.completion.ttft_ms = ms_since(row.started)
            if row.on_first_token is not None:
                row.on_first_token(row.completion)
        row.out.put((token, logprob))
        if token in row.stops:
            row.completion.finish_reason = "stop"
            return True
        return row.generated >= row.sampling.max_tokens or row.cancelled.is_set()

    def _finish(self, row: _Row, kv) -> None:
        row.done = True
        row.completion.total_ms = ms_since(row.started)
        self._request_s = 0.9 * self._request_s + 0.1 * row.completion.total_ms / 1000
        try:
            self._remember(row, kv)
        finally:
            row.out.put(_END)

    def _remember(self, row: _Row, kv) -> None:
        if row.prompt_only is not None:
            self.engine.remember(row.resident, row.ids[: row.completion.prompt_tokens], row.prompt_only)
        elif row.remember and kv is not None and row.generated:
            self.engine.remember(row.resident, row.ids[:-1], Prefix(kv, row.last_logits.clone()))

    @staticmethod
    def _fail(row: _Row, exc: Exception) -> None:
        row.done = True
        row.completion.total_ms = ms_since(row.started)
        log.warning("request on %s failed: %s", row.resident.name, exc)
        row.out.put(exc)

    def _tokens(self, row: _Row):
        """What the request's reader iterates: tokens until the end, or the request's error."""
        try:
            while (item := row.out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not row.done:
                row.cancelled.set()  # its row is freed at the next step
                with self._wakeup:
                    self._wakeup.notify()

    def _retry_after_s(self) -> int:
        """About when a row frees up: the queue ahead, over the rows, times a request's run."""
        waves = (len(self._waiting) + 1) / self.limits.max_running
        return max(1, min(60, math.ceil(waves * self._request_s)))


# Schedulers whose thread may still run at interpreter exit: stopped first, as a thread
# left inside torch while the interpreter tears down aborts the process.
_RUNNING: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for scheduler in list(_RUNNING):
        scheduler.cancel_all()
        scheduler.close(timeout_s=5.0)


def _by_feed_length(group: list[tuple[_Row, Start]]) -> list[list[tuple[_Row, Start]]]:
    """`group` split so that every request feeds at least half as many ids as the longest
    of its part: a pass pre-filling rows together computes rows x longest positions, so a
    long prompt beside short ones would mostly compute padding."""
    ordered = sorted(group, key=lambda pair: -int(pair[1].feed_ids.shape[-1]))
    parts: list[list[tuple[_Row, Start]]] = []
    for pair in ordered:
        feed = int(pair[1].feed_ids.shape[-1])
        if parts and 2 * feed >= int(parts[-1][0][1].feed_ids.shape[-1]):
            parts[-1].append(pair)
        else:
            parts.append([pair])
    return parts


def _croppable(cache) -> bool:
    """Whether a request's starting cache can join a pre-fill together (cut back if need be)."""
    return batchable(cache) and truncatable(cache)


def _cut(cache, keep: int, cached: int):
    """The first `keep` positions of a request's starting cache (a clone: the start itself
    stays whole, should the request be started alone after all)."""
    if keep == cached:
        return cache
    cut = clone_for_request(cache)
    cut.crop(keep - cached)
    return cut


class OnSchedulerThread:
    """The PrefixEngine calls that are not requests (a pre-fill, a probe's first token),
    run on the scheduler's thread between two steps: scheduled with the traffic, one call
    at a time, never beside a decode step on the same device."""

    def __init__(self, engine: PrefixEngine, scheduler: Scheduler) -> None:
        self._engine, self._scheduler = engine, scheduler

    def prefill(self, *args, **kwargs):
        return self._scheduler.call(self._engine.prefill, *args, **kwargs)

    def first_token(self, *args, **kwargs):
        return self._scheduler.call(self._engine.first_token, *args, **kwargs)
