"""The scheduler: one thread decides what every forward pass computes; the runner runs it.

Everything that runs a model goes through it: requests (``submit``), a template's pre-fill
(``prefill``), a warmup's probes and the first-call exercise (requests like any other).
Callers (HTTP handlers, Celery pool threads) hand it work and read a request's
``TextStream``. Each iteration of its loop:

1. runs one queued *call* (a pre-fill) or a piece of *idle work* (with no request, or its
   share beside them: preheat.workers.engine.sidework), so decoding goes on between the pieces;
2. admits waiting requests while their model's running rows, with theirs, fit the KV
   budget (``BatchLimits.running_kv_bytes``: each row as long as its prompt and
   ``max_tokens``) and the step's prompt-token budget lasts: each starts from a clone of the
   longest cached prefix of its ids (``Prefixes.start``), copied into a row of its model's
   running KV (``raggedkv``);
3. plans one *step* per model: every decoding row its next id, the pre-filling rows the
   next chunks of their prompts, up to ``prefill_tokens_per_step`` prompt tokens, oldest
   first; the model's runner runs it as one forward pass (``ModelRunner.step``) and chooses
   each row's token (``ModelRunner.sample``). So an arrival starts within a step or two and
   the running streams keep their pace. A request whose cache cannot run with the others
   runs alone (``lone.LoneRequests``), a chunk or a token an iteration.

Each token goes to ``Request.append_token``, which applies every per-token rule. A request
leaves its row when it finishes, when its reader goes away (the stream closed), or when it
fails: a failure in its own sampling ends that request only; a step that fails for the
batch (out of memory) is undone, and the newest row leaves with the error while the others
go on. A full queue refuses at once (``QueueFullError``: HTTP 429 with Retry-After).
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

import torch

from preheat.api.sampling import SamplingParams
from preheat.workers.engine.batch import Batch, BatchLimits, ModelAsleepError, QueueFullError, Row, SleepRefused, need
from preheat.workers.engine.lone import LoneRequests
from preheat.workers.engine.outcomes import Outcomes
from preheat.workers.engine.prefixes import Prefilled, Prefixes, Start
from preheat.workers.engine.raggedkv import batchable
from preheat.workers.engine.request import Request, RequestStatus, TextStream
from preheat.workers.engine.resident import ResidentModel, check_context
from preheat.workers.engine.sidework import Call, IdleWork

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, prefixes: Prefixes, limits: BatchLimits = BatchLimits()) -> None:
        self.prefixes, self.limits = prefixes, limits
        self._waiting: deque[Request] = deque()
        self._calls: deque[Call] = deque()
        self._batches: dict[str, Batch] = {}
        self.outcomes = Outcomes(prefixes)  # each token, end and failure of a running request
        self._lone = LoneRequests(self.outcomes)
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._asleep: set[str] = set()  # parked models: no request is taken for them
        self._idle = IdleWork()
        self._admitted = 0  # requests given a row so far: each row's order

    # What callers use -----------------------------------------------------------------

    def submit(self, resident: ResidentModel, prompt_ids: torch.Tensor, sampling: SamplingParams, **how) -> TextStream:
        """Queue a request; iterate the stream for its pieces as they are decoded. `how`: the
        Request's options (use_cache, record, remember, arrived, on_first_token)."""
        check_context(resident, prompt_ids.shape[-1], "prompt", new_tokens=sampling.max_tokens)
        request = Request(resident, prompt_ids, sampling, **{"arrived": time.perf_counter(), **how})
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
        """`Prefixes.prefill` on the scheduler's thread, between two steps."""
        return self._call(self.prefixes.prefill, resident, token_ids, **how)

    def call(self, work: Callable[..., object], *args, **kwargs):
        """`work` on the scheduler's thread, between two steps (a model's compile): it alone runs models."""
        return self._call(work, *args, **kwargs)

    def compile(self, runner, mode: str, store, model_digest: str, adapters: bool = False):
        """`runner.compile` on the scheduler's thread (CUDA graphs sized by these limits), then its idle work."""
        report = self._call(runner.compile, mode, store, model_digest, adapters, self.limits)
        with self._wakeup:
            self._idle.add(runner)
            self._wakeup.notify()
        return report

    def park(self, model: str, drain_s: float) -> int:
        """Take no more requests for `model` once those it runs and queues have finished
        (waited for up to `drain_s`, never cut), and free its cached KV; returns the bytes
        freed. Raises SleepRefused, with nothing changed, when they outlast `drain_s`."""
        deadline = time.monotonic() + drain_s
        while (busy := self._call(self._park, model)) is not None:
            if time.monotonic() >= deadline:
                raise SleepRefused(f"{busy} request(s) of {model} still running or waiting after {drain_s:g} s")
            time.sleep(0.02)
        return self._call(self.prefixes.cache.drop_model, model)

    def _park(self, model: str) -> int | None:
        with self._wakeup:
            busy = len(self._model_requests(model)) + sum(request.model == model for request in self._waiting)
            if busy:
                return busy
            self._asleep.add(model)
            self._idle.drop(model)
            self._batches.pop(model, None)  # an empty batch still holds its grown buffers
            return None

    def unpark(self, model: str) -> None:
        with self._wakeup:
            self._asleep.discard(model)

    def load(self) -> dict[str, int]:
        """Requests running and waiting now (metrics, `preheat workers`)."""
        with self._wakeup:
            running = sum(len(b.rows) for b in list(self._batches.values())) + len(self._lone.requests())
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
        job = Call(lambda: work(*args, **kwargs))
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
        return bool(self._calls or self._waiting or self._batches or self._lone.requests())

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not (self._busy() or self._stopping or self._idle):
                    self._wakeup.wait()
                if self._stopping and not self._busy():
                    return
                idle = self._idle.next_piece() if not self._calls and self._idle.due(self._busy()) else None
                call = self._calls.popleft() if self._calls and idle is None else None
            if idle is not None:
                self._idle.run_piece(*idle, self._wakeup)
                continue
            if call is not None:
                try:
                    call.result = call.work()
                except BaseException as exc:  # handed to the caller, who raises it
                    call.error = exc
                finally:
                    call.finished.set()
            try:
                self._admit()
                for model in list(self._batches):
                    self._batches[model].step(self.outcomes, self.limits.prefill_tokens_per_step, not self._waiting)
                    if not self._batches[model].rows:
                        del self._batches[model]
                self._lone.step_all()
            except Exception as exc:  # a fault of the scheduler's own: no reader waits for ever
                log.exception("a scheduler iteration failed; the requests it was running end with its error")
                running = self._lone.take_all() + [r for b in self._batches.values() for r in b.requests]
                self._batches = {}
                for request in running:
                    if not request.status.finished:
                        self.outcomes.fail(request, exc)

    def _taken(self) -> list[Request]:
        return [*self._waiting, *self._lone.requests(), *(r for b in list(self._batches.values()) for r in b.requests)]

    def _model_requests(self, model: str) -> list[Request]:
        """The requests of `model` that hold a row: in its batch, or running alone."""
        batch = self._batches.get(model)
        return (batch.requests if batch else []) + [r for r in self._lone.requests() if r.model == model]

    # Admission ------------------------------------------------------------------------

    def _next_admissible(self, pending: dict[str, list[Request]]) -> Request | None:
        """The first waiting request whose model has room for its row (`pending`: admitted in
        this iteration, not running yet); a cancelled one is taken to be ended. Served
        requests go before off-the-books ones (a warmup's probes, the first-call exercise)."""
        with self._wakeup:
            for served in (True, False):
                for request in self._waiting:
                    if request.record is served and (
                        request.cancelled.is_set()
                        or self.limits.room_for(
                            request, self._model_requests(request.model) + pending.get(request.model, [])
                        )
                    ):
                        self._waiting.remove(request)
                        return request
        return None

    def _admit(self) -> None:
        """Waiting requests join while there is room for their rows and the step's prompt
        budget lasts, each from a clone of its cached entry copied into a row; a request
        whose cache cannot run with the others starts alone."""
        budget = self._lone.continue_prefills(self.limits.prefill_tokens_per_step)
        budget -= sum(len(row.feed) for batch in self._batches.values() for row in batch.rows)
        pending: dict[str, list[Request]] = {}
        while budget > 0 and (request := self._next_admissible(pending)) is not None:
            if request.cancelled.is_set():
                self.outcomes.finish(request, None, RequestStatus.FINISHED_ABORTED)
                continue
            try:
                start = self.prefixes.start(
                    request.resident,
                    request.prompt_ids,
                    use_cache=request.use_cache,
                    record=request.record,
                    adapter=request.adapter,
                )
                request.started(start.cached_tokens, start.reuse_ms)
                budget -= int(start.feed_ids.shape[-1])
                pending.setdefault(request.model, []).append(request)
                self._start(request, start)
            except Exception as exc:
                self.outcomes.fail(request, exc)

    def _start(self, request: Request, start: Start) -> None:
        """The request takes a row of its model's batch: its cached positions copied in, the
        rest of its prompt to feed (a prompt that is a cached entry has its first token now)."""
        batch = self._batches.get(request.model)
        if batch is None and (kv := request.resident.runner.new_batch()) is not None:
            batch = self._batches[request.model] = Batch(kv, runner=request.resident.runner)
        if batch is None or (start.cache is not None and not batchable(start.cache)):
            self._lone.start(request, start, self.limits.prefill_tokens_per_step)
            return
        self._admitted += 1
        if start.logits is not None:
            request.prefilled(start.logits, lambda: start.cache)
            if self.outcomes.append(request, start.logits):
                self.outcomes.finish(request, start.cache)
                return
        batch.kv.add(start.cache, need(request))
        batch.rows.append(Row(request, start.feed_ids[0].tolist(), self._admitted))

    def _retry_after_s(self) -> int:
        """About when a row frees up: the queue ahead, over the rows running now (what the
        KV budget lets run, not the cap), times a request's run."""
        waves = (len(self._waiting) + 1) / max(1, len(self._taken()) - len(self._waiting))
        return max(1, min(60, math.ceil(waves * self.outcomes.request_s)))


# Schedulers whose thread may still run at interpreter exit: stopped first, as a thread
# left inside torch while the interpreter tears down aborts the process.
_RUNNING: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for scheduler in list(_RUNNING):
        scheduler.cancel_all()
        scheduler.close(timeout_s=5.0)
