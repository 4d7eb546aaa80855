"""A model's running batch and one step of it: the rows the scheduler admitted, what the next
forward pass feeds each (`Batch.plan`), the pass run by the model's runner and each row's
token handed back (`Batch.step`). The scheduler (scheduler.py) decides who runs; this runs
them. Also the limits the scheduler admits by, and the errors a caller may meet."""

from __future__ import annotations

from dataclasses import dataclass, field

from preheat.core.errors import PreheatError
from preheat.workers.engine.raggedkv import RaggedKV, Segment
from preheat.workers.engine.request import Request, RequestStatus


class ModelAsleepError(PreheatError):
    """A request for a model that is asleep here: the caller wakes it first (WorkerRuntime)."""


class SleepRefused(PreheatError):
    """A model cannot be parked without cutting a request short: the sleep is refused instead."""


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

    def room_for(self, request: Request, running: list[Request]) -> bool:
        """Whether `request` may run beside `running` (its model's rows, and those admitted
        with it): at most `max_running` of them, and the KV they may need (each as long as
        its prompt and max_tokens, in the batch's slots of the longest) within
        `running_kv_bytes`. A model with nothing running takes one, whatever it needs (the
        context check bounds it)."""
        if len(running) >= self.max_running:
            return False
        if not running:
            return True
        longest = max(need(r) for r in [*running, request])
        return (len(running) + 1) * longest * request.resident.kv_bytes_per_token <= self.running_kv_bytes


@dataclass(eq=False)
class Row:
    """A running request of the batch: its prompt ids still to compute (none once it decodes)."""

    request: Request
    feed: list[int]
    order: int  # when it was admitted: pre-fills go oldest first, the newest leaves on a failed step


@dataclass
class Batch:
    """The running requests of one model: row i holds slot i of `kv`."""

    kv: RaggedKV
    rows: list[Row] = field(default_factory=list)
    runner: object | None = None  # the model's ModelRunner: it made `kv`, runs each step, gets `kv` back at the end

    @property
    def requests(self) -> list[Request]:
        return [row.request for row in self.rows]

    def plan(self, prefill_budget: int, alone: bool) -> list[Segment]:
        """What the step feeds each row: its next id when it decodes; the next chunk of its
        prompt when it pre-fills, oldest first, up to the step's prompt budget (a lone
        prompt with nothing else to do is computed whole: two passes cost more than one)."""
        kv, rows = self.kv, self.rows
        decoding = [slot for slot, row in enumerate(rows) if not row.feed]
        segments = [Segment(slot, kv.lengths[slot], (rows[slot].request.ids[-1],)) for slot in decoding]
        prefilling = sorted((row.order, slot) for slot, row in enumerate(rows) if row.feed)
        budget = prefill_budget
        if len(prefilling) == 1 and not decoding and alone:
            budget = len(rows[prefilling[0][1]].feed)
        for _, slot in prefilling:
            if budget <= 0:
                break
            chunk = rows[slot].feed[:budget]
            budget -= len(chunk)
            segments.append(Segment(slot, kv.lengths[slot], tuple(chunk)))
        return segments

    def step(self, outcomes, prefill_budget: int, alone: bool) -> None:
        """One forward pass of the rows (`plan`) by their model's runner, each row's token
        chosen and handed to `outcomes` (outcomes.Outcomes: accept, fail, finish, decoded);
        rows whose reader went away, or that finished, leave."""
        self.drop(outcomes, [slot for slot, row in enumerate(self.rows) if row.request.cancelled.is_set()])
        if not self.rows:
            return
        runner, segments = self.runner, self.plan(prefill_budget, alone)
        before = self.kv.snapshot()
        try:
            logits = runner.step(self.kv, segments, [self.rows[s.slot].request.adapter for s in segments])
        except Exception as exc:
            # Undone for all; the newest row (the one that made the batch this large) leaves.
            self.kv.restore(before)
            newest = max(range(len(self.rows)), key=lambda slot: self.rows[slot].order)
            outcomes.fail(self.rows[newest].request, exc)
            self.drop(outcomes, [newest])
            return
        self.kv.stepped()
        choosing, rows_logits, chose = [], [], []  # the rows that choose a token this step, and their segments
        for at, (segment, row_logits) in enumerate(zip(segments, logits.unbind(0), strict=True)):
            row = self.rows[segment.slot]
            if row.feed:
                row.feed = row.feed[len(segment.ids) :]
                if row.feed:
                    continue
                # The row's KV copied out only where the request may need it (a window).
                own_kv = (lambda slot=segment.slot: self.kv.row(slot)) if any(self.kv.windows) else None
                row.request.prefilled(row_logits, own_kv)
            choosing.append(segment.slot)
            rows_logits.append(row_logits)
            chose.append(at)
        leaving = []
        if choosing:
            # The step's logits as they are where every segment chooses (a copy of a 49,152-token
            # bf16 row cost 0.12 ms a step, a single user's every token).
            stacked = logits if len(chose) == len(segments) else logits[chose]
            chosen = runner.sample([self.rows[slot].request for slot in choosing], stacked)
            for slot, row_logits, choice in zip(choosing, rows_logits, chosen, strict=True):
                if outcomes.accept(self.rows[slot].request, choice, row_logits):
                    leaving.append(slot)
        outcomes.decoded(sum(1 for segment in segments if len(segment.ids) == 1))
        self.drop(outcomes, leaving)

    def drop(self, outcomes, slots: list[int]) -> None:
        """Take the rows in `slots` out of the batch; those that did not fail are finished (a
        row still running leaves because its reader went away)."""
        for slot in slots:
            request = self.rows[slot].request
            if request.status is RequestStatus.FINISHED_FAILED:
                continue
            # Its KV is copied out only for a request that remembers (see Request.to_remember).
            kv = self.kv.row(slot) if request.remember and not self.rows[slot].feed else None
            outcomes.finish(request, kv, None if request.status.finished else RequestStatus.FINISHED_ABORTED)
        for slot in sorted(slots, reverse=True):  # the last row moves into a freed slot: highest first
            if self.kv.remove(slot) is not None:
                self.rows[slot] = self.rows[-1]
            self.rows.pop()
        if slots and not self.rows and self.runner is not None:  # the scheduler lets the batch go
            self.runner.keep_batch_kv(self.kv)


def need(request: Request) -> int:
    """Positions a request's row may hold: its prompt and every token it may generate."""
    positions = request.prompt_tokens + request.sampling.max_tokens
    return min(positions, request.resident.max_context) if request.resident.max_context else positions
