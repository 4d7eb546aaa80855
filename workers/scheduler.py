"""The scheduler: the one thread that runs the model, for requests and everything else.

Everything that runs a forward pass goes through it: requests (``submit``), a template's
pre-fill (``prefill``), a warmup's probes and the first-call exercise (requests like any
other). Callers (HTTP handlers, Celery pool threads) hand it work and read a request's
``TextStream``; nothing else touches the model. Each iteration of its loop:

1. runs one queued *call* (a pre-fill): work that is not a request is scheduled with the
   traffic, one piece per iteration, so decoding goes on between the pieces;
2. admits waiting requests while their model has a free row and the iteration's
   prompt-token budget lasts: each starts from a clone of the longest cached prefix of its
   ids (``PrefixCache.start``: the entry is held only while it is cloned) and computes its
   own remaining ids; those of one model are pre-filled together where their caches allow it,
   a prompt longer than the budget a chunk an iteration;
3. runs one decode step per model: a single forward pass feeds every running row its next
   token (``workers.batchkv``). A request whose cache cannot join a batch (layers that are
   written in place, or of other shapes) runs as a batch of one.

Each token goes to ``Request.append_token``, which applies every per-token rule
(workers/request.py). A request leaves its row when it finishes, when its reader goes away
(the stream closed), or when it fails: a failure in its own pre-fill or sampling ends that
request only; a decode step that fails for the batch (out of memory) is undone, and the
newest row leaves with the error while the others go on. A full queue refuses at once
(``QueueFullError``: HTTP 429 with Retry-After).
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from preheat.errors import PreheatError
from workers.batchkv import BatchKV, batchable
from workers.device import out_of_memory_as_error
from workers.prefix import check_context, clone_for_request, forward, truncatable
from workers.prefixcache import Prefilled, PrefixCache, Start
from workers.request import Request, RequestStatus, TextStream
from workers.resident import ResidentModel
from workers.sampling import SamplingParams

log = logging.getLogger(__name__)


class ModelAsleepError(PreheatError):
    """A request for a model that is asleep here: the caller wakes it first (WorkerRuntime)."""


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


@dataclass
class _Batch:
    """The running requests of one model whose caches are one left-padded cache."""

    kv: BatchKV
    requests: list[Request] = field(default_factory=list)


@dataclass(eq=False)
class _Single:
    """A running request whose cache cannot be batched: a batch of one, its own cache."""

    request: Request
    kv: object


@dataclass(eq=False)
class _Prefilling:
    """A request whose prompt is longer than one iteration's budget: computed a chunk an
    iteration, with decode steps for the others in between."""

    request: Request
    kv: object
    feed: torch.Tensor  # the ids still to compute, [1, n]


@dataclass(eq=False)
class _Call:
    work: Callable[[], object]
    finished: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class Scheduler:
    def __init__(self, prefixes: PrefixCache, limits: BatchLimits = BatchLimits()) -> None:
        self.prefixes, self.limits = prefixes, limits
        self._waiting: deque[Request] = deque()
        self._calls: deque[_Call] = deque()
        self._batches: dict[str, _Batch] = {}
        self._singles: list[_Single] = []
        self._prefilling: list[_Prefilling] = []
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._asleep: set[str] = set()  # parked models: no request is taken for them
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
        arrived: float | None = None,
        on_first_token: Callable[[Request], None] | None = None,
    ) -> TextStream:
        """Queue a request; iterate the stream for its pieces as they are decoded. `arrived`
        (perf_counter): when the request came, so TTFT includes what the caller did first
        (rendering, tokenizing). With `remember`, its prompt and answer stay cached for a
        follow-up (a conversation's next turn, another choice)."""
        check_context(resident, prompt_ids.shape[-1], "prompt", new_tokens=sampling.max_tokens)
        request = Request(
            resident,
            prompt_ids,
            sampling,
            use_cache=use_cache,
            record=record,
            remember=remember,
            arrived=arrived if arrived is not None else time.perf_counter(),
            on_first_token=on_first_token,
        )
        with self._wakeup:
            if resident.name in self._asleep:
                raise ModelAsleepError(f"model {resident.name} is asleep")
            if len(self._waiting) >= self.limits.max_queued:
                raise QueueFullError(len(self._waiting), self._retry_after_s())
            self._waiting.append(request)
            self._start_thread()
            self._wakeup.notify()
        return TextStream(request)

    def prefill(self, resident: ResidentModel, token_ids: torch.Tensor, **how) -> Prefilled:
        """`PrefixCache.prefill` on the scheduler's thread, between two steps."""
        return self._call(self.prefixes.prefill, resident, token_ids, **how)

    def park(self, model: str, drain_s: float) -> int:
        """Take no more requests for `model` once those it runs and queues have finished
        (waited for up to `drain_s`, never cut), and free its cached KV; returns the bytes
        freed. Raises SleepRefused, with nothing changed, when they outlast `drain_s`."""
        from workers.sleep import SleepRefused

        deadline = time.monotonic() + drain_s
        while (busy := self._call(self._park, model)) is not None:
            if time.monotonic() >= deadline:
                raise SleepRefused(f"{busy} request(s) of {model} still running or waiting after {drain_s:g} s")
            time.sleep(0.02)
        return self._call(self.prefixes.cache.drop_model, model)

    def _park(self, model: str) -> int | None:
        """On the scheduler's thread, between two steps: the requests of `model` it still
        has, or None once it has none and the model is parked."""
        with self._wakeup:
            busy = self._rows(model) + sum(request.model == model for request in self._waiting)
            if busy:
                return busy
            self._asleep.add(model)
            self._batches.pop(model, None)  # an empty batch still holds its grown buffers
            return None

    def unpark(self, model: str) -> None:
        with self._wakeup:
            self._asleep.discard(model)

    def load(self) -> dict[str, int]:
        """Requests running and waiting now (metrics, `preheat workers`)."""
        with self._wakeup:
            running = sum(len(b.requests) for b in list(self._batches.values()))
            running += len(self._prefilling) + len(self._singles)
            return {"running": running, "waiting": len(self._waiting), "max_running": self.limits.max_running}

    def cancel_all(self) -> None:
        """Every request taken ends at the next step (the process is exiting)."""
        with self._wakeup:
            for request in self._taken():
                request.cancel()
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

    def _call(self, work: Callable[..., object], *args, **kwargs):
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

    def _start_thread(self) -> None:
        if self._thread is None:
            _RUNNING.add(self)
            self._thread = threading.Thread(target=self._run, name="preheat-engine", daemon=True)
            self._thread.start()

    def _busy(self) -> bool:
        return bool(self._calls or self._waiting or self._batches or self._singles or self._prefilling)

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not (self._busy() or self._stopping):
                    self._wakeup.wait()
                if self._stopping and not self._busy():
                    return
                call = self._calls.popleft() if self._calls else None
            if call is not None:
                self._run_call(call)
            try:
                self._admit()
                for model in list(self._batches):
                    self._step(model)
                for single in list(self._singles):
                    self._step_single(single)
            except Exception as exc:  # a fault of the scheduler's own: no reader waits for ever
                log.exception("a scheduler iteration failed; the requests it was running end with its error")
                self._fail_running(exc)

    @staticmethod
    def _run_call(call: _Call) -> None:
        try:
            call.result = call.work()
        except BaseException as exc:  # handed to the caller, who raises it
            call.error = exc
        finally:
            call.finished.set()

    def _fail_running(self, exc: Exception) -> None:
        """Every request with a row ends with `exc` (those waiting go on)."""
        running = [p.request for p in self._prefilling] + [s.request for s in self._singles]
        running += [r for batch in self._batches.values() for r in batch.requests]
        self._prefilling, self._singles, self._batches = [], [], {}
        for request in running:
            if not request.status.finished:
                self._fail(request, exc)

    def _taken(self) -> list[Request]:
        requests = [*self._waiting, *(p.request for p in self._prefilling), *(s.request for s in self._singles)]
        return requests + [r for batch in list(self._batches.values()) for r in batch.requests]

    def _rows(self, model: str) -> int:
        """The rows `model`'s requests hold: decoding, alone or batched, and pre-filling."""
        batch = self._batches.get(model)
        return (
            (len(batch.requests) if batch else 0)
            + sum(s.request.model == model for s in self._singles)
            + sum(p.request.model == model for p in self._prefilling)
        )

    # Admission ------------------------------------------------------------------------

    def _next_admissible(self, pending: dict[str, int]) -> Request | None:
        """The first waiting request whose model has a free row (`pending`: admitted in this
        iteration, not running yet); a cancelled one is taken to be ended. Served requests
        go before off-the-books ones (a warmup's probes, the first-call exercise): a user
        never waits behind a measurement, at most behind the pass it is in."""
        with self._wakeup:
            for served in (True, False):
                for request in self._waiting:
                    if request.record is not served:
                        continue
                    rows = self._rows(request.model) + pending.get(request.model, 0)
                    if request.cancelled.is_set() or rows < self.limits.max_running:
                        self._waiting.remove(request)
                        return request
        return None

    def _admit(self) -> None:
        """Waiting requests join, up to the iteration's prompt-token budget, each from a
        clone of its cached entry (PrefixCache.start). Those of one model that start from a
        cache that can be cut (or none) are pre-filled together, in one forward pass; the
        others (a prompt that is a cached entry, a window past its size) one by one."""
        budget = self._continue_prefills(self.limits.prefill_tokens_per_step)
        admitted: list[tuple[Request, Start]] = []
        pending: dict[str, int] = {}
        while budget > 0 and (request := self._next_admissible(pending)) is not None:
            if request.cancelled.is_set():
                self._finish(request, None, RequestStatus.FINISHED_ABORTED)
                continue
            try:
                start = self.prefixes.start(
                    request.resident, request.prompt_ids, use_cache=request.use_cache, record=request.record
                )
            except Exception as exc:
                self._fail(request, exc)
                continue
            request.started(start.cached_tokens, start.reuse_ms)
            admitted.append((request, start))
            pending[request.model] = pending.get(request.model, 0) + 1
            budget -= max(1, int(start.feed_ids.shape[-1]))
        # A prompt is cut into chunks so that other rows decode between them: a request with
        # nothing else running or waiting is computed whole (two passes cost more than one).
        chunk = self.limits.prefill_tokens_per_step
        if len(admitted) == 1 and not (self._batches or self._singles or self._prefilling or self._waiting):
            chunk = int(admitted[0][1].feed_ids.shape[-1])
        groups: dict[str, list[tuple[Request, Start]]] = {}
        for request, start in admitted:
            if start.logits is None and (start.cache is None or _croppable(start.cache)):
                groups.setdefault(request.model, []).append((request, start))
            else:
                self._start_alone(request, start, chunk)
        for group in groups.values():
            for similar in _by_feed_length(group):
                if len(similar) > 1 and any(start.cache is not None for _, start in similar):
                    self._prefill_together(similar)
                else:
                    for request, start in similar:
                        self._start_alone(request, start, chunk)

    def _start_alone(self, request: Request, start: Start, chunk: int | None = None) -> None:
        """Pre-fill one request from its start and choose its first token; a prompt longer
        than `chunk` (an iteration's budget) is computed a chunk an iteration. A failure here
        is the request's alone."""
        try:
            if start.logits is not None:
                self._first_token(request, start.logits, start.cache)
                return
            prefilling = _Prefilling(request, start.cache, start.feed_ids)
            if not self._advance(prefilling, chunk or self.limits.prefill_tokens_per_step):
                self._prefilling.append(prefilling)
        except Exception as exc:
            self._fail(request, exc)

    def _continue_prefills(self, budget: int) -> int:
        """Each long prompt under way gets its next chunk, while the budget lasts; returns
        what is left of it."""
        under_way = []
        for prefilling in self._prefilling:
            if prefilling.request.cancelled.is_set():
                self._finish(prefilling.request, None, RequestStatus.FINISHED_ABORTED)
            elif budget <= 0:
                under_way.append(prefilling)
            else:
                chunk = min(budget, int(prefilling.feed.shape[-1]))
                budget -= chunk
                try:
                    if not self._advance(prefilling, chunk):
                        under_way.append(prefilling)
                except Exception as exc:
                    self._fail(prefilling.request, exc)
        self._prefilling = under_way
        return budget

    def _advance(self, prefilling: _Prefilling, tokens: int) -> bool:
        """Compute the next `tokens` ids of a prompt; True once its first token is chosen."""
        piece, prefilling.feed = prefilling.feed[:, :tokens], prefilling.feed[:, tokens:]
        logits, prefilling.kv = forward(prefilling.request.resident, piece, prefilling.kv)
        if prefilling.feed.shape[-1]:
            return False
        self._first_token(prefilling.request, logits, prefilling.kv)
        return True

    def _first_token(self, request: Request, logits: torch.Tensor, kv) -> None:
        request.prefilled(logits, lambda: kv)
        if request.append_token(logits):
            self._finish(request, kv)
        else:
            self._join(request, kv)

    def _prefill_together(self, group: list[tuple[Request, Start]]) -> None:
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
            for request, start in group:
                keep = max(0, len(request.ids) - longest)
                kv.add(_cut(start.cache, keep, start.cached_tokens) if keep else shell, keep)
                feeds.append(request.ids[keep:])
            logits = self._forward_inputs(resident, kv, kv.prefill_inputs(feeds, 0), len(group))
            kv.prefilled(feeds)
        except Exception as exc:
            log.info("pre-filling %d requests together failed (%s): one by one", len(group), exc)
            for request, start in group:
                self._start_alone(request, start)
            return
        requests = [request for request, _ in group]
        for i, request in enumerate(requests):
            request.prefilled(logits[i], lambda i=i: kv.row(i))
        batch = self._batches.get(resident.name)
        if batch is None:
            batch = self._batches[resident.name] = _Batch(kv)
        else:
            batch.kv.merge(kv)
        first = len(batch.requests)
        batch.requests += requests
        self._drop(batch, [first + i for i, request in enumerate(requests) if self._append(request, logits[i])])

    def _join(self, request: Request, kv) -> None:
        """A request whose first token is chosen joins its model's batch (or runs alone)."""
        if not batchable(kv):
            self._singles.append(_Single(request, kv))
            return
        batch = self._batches.get(request.model)
        if batch is None:
            batch = self._batches[request.model] = _Batch(BatchKV.like(kv))
        batch.kv.add(kv, len(request.ids) - 1)  # every id but the one just chosen, which the next step feeds
        batch.requests.append(request)

    # Decode steps ---------------------------------------------------------------------

    def _step(self, model: str) -> None:
        batch = self._batches[model]
        self._drop(batch, [i for i, request in enumerate(batch.requests) if request.cancelled.is_set()])
        if not batch.requests:
            del self._batches[model]
            return
        resident = batch.requests[0].resident
        before = batch.kv.snapshot()
        try:
            logits = self._forward(resident, batch)
        except Exception as exc:
            # Undone for all; the newest row (the one that made the batch this large) leaves.
            batch.kv.restore(before)
            self._fail(batch.requests[-1], exc)
            self._drop(batch, [len(batch.requests) - 1])
            return
        batch.kv.stepped()
        self.steps, self.rows_stepped = self.steps + 1, self.rows_stepped + len(batch.requests)
        self._drop(batch, [i for i, request in enumerate(batch.requests) if self._append(request, logits[i])])

    def _step_single(self, single: _Single) -> None:
        request = single.request
        done = request.cancelled.is_set()
        if not done:
            try:
                logits, single.kv = forward(request.resident, torch.tensor([[request.ids[-1]]]), single.kv)
                self.steps, self.rows_stepped = self.steps + 1, self.rows_stepped + 1
            except Exception as exc:
                self._singles.remove(single)
                self._fail(request, exc)
                return
            done = self._append(request, logits)
        if done:
            self._singles.remove(single)
            if request.status is not RequestStatus.FINISHED_FAILED:
                self._finish(request, single.kv, None if request.status.finished else RequestStatus.FINISHED_ABORTED)

    @classmethod
    def _forward(cls, resident: ResidentModel, batch: _Batch) -> torch.Tensor:
        inputs = batch.kv.step_inputs([request.ids[-1] for request in batch.requests])
        return cls._forward_inputs(resident, batch.kv, inputs, len(batch.requests))

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
        """Take `rows` out of the batch; those that did not fail are finished (a row still
        running leaves because its reader went away)."""
        if not rows:
            return
        for i in rows:
            request = batch.requests[i]
            if request.status is RequestStatus.FINISHED_FAILED:
                continue
            # Its KV is copied out only for a request that remembers (see Request.to_remember).
            kv = batch.kv.row(i) if request.remember else None
            self._finish(request, kv, None if request.status.finished else RequestStatus.FINISHED_ABORTED)
        leaving = set(rows)
        keep = [i for i in range(len(batch.requests)) if i not in leaving]
        batch.kv.keep(keep)
        batch.requests = [batch.requests[i] for i in keep]

    # One request's end ----------------------------------------------------------------

    def _append(self, request: Request, logits: torch.Tensor) -> bool:
        """`Request.append_token`; a failure (its sampler's) ends the request with its
        error. True: it leaves its row."""
        try:
            return request.append_token(logits)
        except Exception as exc:
            self._fail(request, exc)
            return True

    def _finish(self, request: Request, kv, status: RequestStatus | None = None) -> None:
        """What it leaves cached first (a follow-up sent the moment the reader has the
        completion finds it), then the completion to the reader."""
        try:
            if (kept := request.to_remember(kv)) is not None:
                self.prefixes.remember(request.resident, *kept)
        finally:
            completion = request.finish(status)
            self._request_s = 0.9 * self._request_s + 0.1 * completion.total_ms / 1000

    @staticmethod
    def _fail(request: Request, exc: Exception) -> None:
        log.warning("request on %s failed: %s", request.model, exc)
        request.fail(exc)

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


def _by_feed_length(group: list[tuple[Request, Start]]) -> list[list[tuple[Request, Start]]]:
    """`group` split so that every request feeds at least half as many ids as the longest
    of its part: a pass pre-filling rows together computes rows x longest positions, so a
    long prompt beside short ones would mostly compute padding."""
    ordered = sorted(group, key=lambda pair: -int(pair[1].feed_ids.shape[-1]))
    parts: list[list[tuple[Request, Start]]] = []
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
