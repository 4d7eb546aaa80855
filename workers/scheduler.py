"""The scheduler: the one thread that runs the model, for requests and everything else.

Everything that runs a forward pass goes through it: requests (``submit``), a template's
pre-fill (``prefill``), a warmup's probes and the first-call exercise (requests like any
other). Callers (HTTP handlers, Celery pool threads) hand it work and read a request's
``TextStream``; nothing else touches the model. Each iteration of its loop:

1. runs one queued *call* (a pre-fill): work that is not a request is scheduled with the
   traffic, one piece per iteration, so decoding goes on between the pieces;
2. admits waiting requests while their model's running rows, with theirs, fit the KV
   budget (``BatchLimits.running_kv_bytes``: each row as long as its prompt and
   ``max_tokens``) and the step's prompt-token budget lasts: each starts from a clone of the
   longest cached prefix of its ids (``PrefixCache.start``), copied into a row of its
   model's running KV (``workers.raggedkv``);
3. runs one *step* per model: a single forward pass feeds every decoding row its next id
   and the pre-filling rows the next chunks of their prompts, up to
   ``prefill_tokens_per_step`` prompt tokens, oldest first. So an arrival starts within a
   step or two and the running streams keep their pace. A request whose cache cannot run
   with the others (layers written in place, or of other shapes) runs alone, a chunk or a
   token an iteration.

Each token goes to ``Request.append_token``, which applies every per-token rule
(workers/request.py). A request leaves its row when it finishes, when its reader goes away
(the stream closed), or when it fails: a failure in its own sampling ends that request
only; a step that fails for the batch (out of memory) is undone, and the newest row leaves
with the error while the others go on. A full queue refuses at once (``QueueFullError``:
HTTP 429 with Retry-After).
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
from workers.device import out_of_memory_as_error
from workers.prefix import cache_nbytes, check_context, forward
from workers.prefixcache import Prefilled, PrefixCache, Start
from workers.raggedkv import RaggedKV, Segment, batchable
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
    max_running: int = 64  # rows running together, per model, at most (the KV budget decides below it)
    max_queued: int = 64  # requests waiting for a row; one more is refused
    prefill_tokens_per_step: int = 128  # prompt tokens a step computes beside its decoding rows
    running_kv_bytes: int = 2 * 1024**3  # the KV the running rows of a model may need

    def __post_init__(self) -> None:
        for name in ("max_running", "max_queued", "prefill_tokens_per_step", "running_kv_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(eq=False)
class _Row:
    """A running request of the batch: its prompt ids still to compute (none once it decodes)."""

    request: Request
    feed: list[int]
    order: int  # when it was admitted: pre-fills go oldest first, the newest leaves on a failed step


@dataclass
class _Batch:
    """The running requests of one model: row i holds slot i of `kv`."""

    kv: RaggedKV
    rows: list[_Row] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return [row.request for row in self.rows]


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
        self._token_bytes: dict[str, int] = {}  # KV bytes per position, per model
        self._admitted = 0  # requests given a row so far: each row's order
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
            busy = len(self._model_requests(model)) + sum(request.model == model for request in self._waiting)
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

    def _model_requests(self, model: str) -> list[Request]:
        """The requests of `model` that hold a row: in its batch, or running alone."""
        batch = self._batches.get(model)
        alone = [s.request for s in self._singles] + [p.request for p in self._prefilling]
        return (batch.requests if batch else []) + [r for r in alone if r.model == model]

    # Admission ------------------------------------------------------------------------

    def _next_admissible(self, pending: dict[str, list[Request]]) -> Request | None:
        """The first waiting request whose model has room for its row (`pending`: admitted
        in this iteration, not running yet); a cancelled one is taken to be ended. Served
        requests go before off-the-books ones (a warmup's probes, the first-call exercise):
        a user never waits behind a measurement, at most behind the step it is in."""
        with self._wakeup:
            for served in (True, False):
                for request in self._waiting:
                    if request.record is not served:
                        continue
                    if request.cancelled.is_set() or self._room_for(request, pending.get(request.model, [])):
                        self._waiting.remove(request)
                        return request
        return None

    def _room_for(self, request: Request, pending: list[Request]) -> bool:
        """Whether `request` may run beside its model's rows: at most `max_running` of them,
        and the KV they may need (each as long as its prompt and max_tokens, in the batch's
        slots of the longest) within `running_kv_bytes`. A model with nothing running takes
        one, whatever it needs (the context check bounds it)."""
        running = self._model_requests(request.model) + pending
        if len(running) >= self.limits.max_running:
            return False
        if not running:
            return True
        longest = max(_need(r) for r in [*running, request])
        per_token = self._token_bytes.get(request.model, 0)  # measured when its first request started
        return (len(running) + 1) * longest * per_token <= self.limits.running_kv_bytes

    def _bytes_per_token(self, resident: ResidentModel) -> int:
        """Bytes one position of the model's KV takes, every layer's keys and values (measured
        once, with a pass of one id, on the scheduler's thread)."""
        if resident.name not in self._token_bytes:
            _, kv = forward(resident, torch.zeros((1, 1), dtype=torch.long))
            self._token_bytes[resident.name] = cache_nbytes(kv)
        return self._token_bytes[resident.name]

    def _admit(self) -> None:
        """Waiting requests join while there is room for their rows and the step's prompt
        budget lasts, each from a clone of its cached entry (PrefixCache.start) copied into a
        row; a request whose cache cannot run with the others starts alone."""
        budget = self._continue_prefills(self.limits.prefill_tokens_per_step)
        budget -= sum(len(row.feed) for batch in self._batches.values() for row in batch.rows)
        pending: dict[str, list[Request]] = {}
        while budget > 0 and (request := self._next_admissible(pending)) is not None:
            if request.cancelled.is_set():
                self._finish(request, None, RequestStatus.FINISHED_ABORTED)
                continue
            try:
                start = self.prefixes.start(
                    request.resident, request.prompt_ids, use_cache=request.use_cache, record=request.record
                )
                request.started(start.cached_tokens, start.reuse_ms)
                budget -= int(start.feed_ids.shape[-1])
                pending.setdefault(request.model, []).append(request)
                self._start(request, start)
            except Exception as exc:
                self._fail(request, exc)

    def _start(self, request: Request, start: Start) -> None:
        """The request takes a row of its model's batch: its cached positions copied in, the
        rest of its prompt to feed (a prompt that is a cached entry has its first token now)."""
        self._bytes_per_token(request.resident)
        batch = self._batch_for(request, start.cache)
        if batch is None:
            self._start_alone(request, start)
            return
        self._admitted += 1
        if start.logits is None:
            batch.kv.add(start.cache, _need(request))
            batch.rows.append(_Row(request, start.feed_ids[0].tolist(), self._admitted))
            return
        request.prefilled(start.logits, lambda: start.cache)
        if request.append_token(start.logits):
            self._finish(request, start.cache)
            return
        batch.kv.add(start.cache, _need(request))
        batch.rows.append(_Row(request, [], self._admitted))

    def _batch_for(self, request: Request, cache) -> _Batch | None:
        """The batch of the request's model, made at its first row; None when the request
        cannot run in it (its cache's layers, or an attention the rows' pass cannot run)."""
        batch = self._batches.get(request.model)
        if batch is None:
            from transformers import DynamicCache

            shell = DynamicCache(config=request.resident.model.config)
            if not (batchable(shell) and ragged_attention(request.resident)):
                return None
            batch = self._batches[request.model] = _Batch(RaggedKV(shell, request.resident.placement.device))
        return batch if cache is None or batchable(cache) else None

    def _start_alone(self, request: Request, start: Start) -> None:
        """A request that runs by itself: its prompt a chunk an iteration, then a token an
        iteration. A failure here is the request's alone."""
        try:
            if start.logits is not None:
                self._first_token_alone(request, start.logits, start.cache)
                return
            prefilling = _Prefilling(request, start.cache, start.feed_ids)
            if not self._advance(prefilling, self.limits.prefill_tokens_per_step):
                self._prefilling.append(prefilling)
        except Exception as exc:
            self._fail(request, exc)

    def _continue_prefills(self, budget: int) -> int:
        """Each prompt running alone gets its next chunk, while the budget lasts; returns
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
        """Compute the next `tokens` ids of a prompt running alone; True once its first token is chosen."""
        piece, prefilling.feed = prefilling.feed[:, :tokens], prefilling.feed[:, tokens:]
        logits, prefilling.kv = forward(prefilling.request.resident, piece, prefilling.kv)
        if prefilling.feed.shape[-1]:
            return False
        self._first_token_alone(prefilling.request, logits, prefilling.kv)
        return True

    def _first_token_alone(self, request: Request, logits: torch.Tensor, kv) -> None:
        request.prefilled(logits, lambda: kv)
        if request.append_token(logits):
            self._finish(request, kv)
        else:
            self._singles.append(_Single(request, kv))

    # Steps ----------------------------------------------------------------------------

    def _segments(self, batch: _Batch) -> list[Segment]:
        """What the step feeds each row: its next id when it decodes; the next chunk of its
        prompt when it pre-fills, oldest first, up to the step's prompt budget (a lone
        prompt with nothing else to do is computed whole: two passes cost more than one)."""
        kv, segments = batch.kv, []
        decoding = [slot for slot, row in enumerate(batch.rows) if not row.feed]
        for slot in decoding:
            segments.append(Segment(slot, kv.lengths[slot], (batch.rows[slot].request.ids[-1],)))
        prefilling = sorted((row.order, slot) for slot, row in enumerate(batch.rows) if row.feed)
        budget = self.limits.prefill_tokens_per_step
        if len(prefilling) == 1 and not decoding and not self._waiting:
            budget = len(batch.rows[prefilling[0][1]].feed)
        for _, slot in prefilling:
            if budget <= 0:
                break
            chunk = batch.rows[slot].feed[:budget]
            budget -= len(chunk)
            segments.append(Segment(slot, kv.lengths[slot], tuple(chunk)))
        return segments

    def _step(self, model: str) -> None:
        batch = self._batches[model]
        self._drop(batch, [slot for slot, row in enumerate(batch.rows) if row.request.cancelled.is_set()])
        if not batch.rows:
            del self._batches[model]
            return
        resident = batch.rows[0].request.resident
        segments = self._segments(batch)
        before = batch.kv.snapshot()
        try:
            logits = self._forward(resident, batch.kv, segments)
        except Exception as exc:
            # Undone for all; the newest row (the one that made the batch this large) leaves.
            batch.kv.restore(before)
            newest = max(range(len(batch.rows)), key=lambda slot: batch.rows[slot].order)
            self._fail(batch.rows[newest].request, exc)
            self._drop(batch, [newest])
            return
        batch.kv.stepped()
        leaving = []
        decoded = 0
        for segment, row_logits in zip(segments, logits, strict=True):
            row = batch.rows[segment.slot]
            if row.feed:
                row.feed = row.feed[len(segment.ids) :]
                if row.feed:
                    continue
                row.request.prefilled(row_logits, lambda slot=segment.slot: batch.kv.row(slot))
            else:
                decoded += 1
            if self._append(row.request, row_logits):
                leaving.append(segment.slot)
        self.steps, self.rows_stepped = self.steps + 1, self.rows_stepped + decoded
        self._drop(batch, leaving)

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

    @staticmethod
    def _forward(resident: ResidentModel, kv: RaggedKV, segments: list[Segment]) -> torch.Tensor:
        """The step's one forward pass: the logits after each segment's last id, [segments, vocab]."""
        fed = sum(len(segment.ids) for segment in segments)
        doing = f"running {len(segments)} requests together on {resident.name} ({fed} ids)"

        def run():
            with torch.inference_mode():
                return resident.model(**kv.step_inputs(segments), use_cache=True, **{resident.cache_kwarg: kv}).logits[
                    0
                ]

        return out_of_memory_as_error(resident.placement.device, doing, run)

    def _drop(self, batch: _Batch, slots: list[int]) -> None:
        """Take the rows in `slots` out of the batch; those that did not fail are finished (a
        row still running leaves because its reader went away)."""
        for slot in slots:
            request = batch.rows[slot].request
            if request.status is RequestStatus.FINISHED_FAILED:
                continue
            # Its KV is copied out only for a request that remembers (see Request.to_remember).
            kv = batch.kv.row(slot) if request.remember and not batch.rows[slot].feed else None
            self._finish(request, kv, None if request.status.finished else RequestStatus.FINISHED_ABORTED)
        for slot in sorted(slots, reverse=True):  # the last row moves into a freed slot: highest first
            if batch.kv.remove(slot) is not None:
                batch.rows[slot] = batch.rows[-1]
            batch.rows.pop()

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
        """About when a row frees up: the queue ahead, over the rows running now (what the
        KV budget lets run, not the cap), times a request's run."""
        waves = (len(self._waiting) + 1) / max(1, len(self._taken()) - len(self._waiting))
        return max(1, min(60, math.ceil(waves * self._request_s)))


# Schedulers whose thread may still run at interpreter exit: stopped first, as a thread
# left inside torch while the interpreter tears down aborts the process.
_RUNNING: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for scheduler in list(_RUNNING):
        scheduler.cancel_all()
        scheduler.close(timeout_s=5.0)


def _need(request: Request) -> int:
    """Positions a request's row may hold: its prompt and every token it may generate."""
    need = request.prompt_tokens + request.sampling.max_tokens
    return min(need, request.resident.max_context) if request.resident.max_context else need


def ragged_attention(resident: ResidentModel) -> bool:
    """Whether the model's attention is preheat's, which runs the rows' pass (workers/attention.py)."""
    from workers import attention

    return resident.model.config._attn_implementation == attention.NAME
