"""One request, from its submission to its last token: its state and every per-token rule.

The scheduler (``preheat.workers.engine.scheduler``) owns a request while it runs: the runner
computes the logits and chooses the token by the request's own sampler, and
``Request.append_token`` applies everything a token brings, in one place (vLLM's ``Request``
with its ``check_stop``): the time to the first token, the text released to the reader
(stop strings matched across token boundaries and never released), an end-of-sequence id,
``max_tokens``, a reader gone. When
it ends, the request reports a ``Completion``, written once, by the scheduler's thread, and
says what of it stays cached for a follow-up (``to_remember``).

The caller holds a ``TextStream``: the pieces of text as they are released, then the
completion. Nothing here runs the model, so every rule is testable with logits made by hand.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from preheat.api.sampling import SamplingError, SamplingParams, TokenLogprob
from preheat.workers.engine.kvtensors import Prefix, clone_for_request, has_window, truncatable
from preheat.workers.engine.resident import ResidentModel
from preheat.workers.engine.sampling import ModelDefaults, Sampler, sampler_for


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for a row
    PREFILLING = "prefilling"  # it has a row; its prompt is being computed (a chunk a step if long)
    RUNNING = "running"  # decoding
    FINISHED_STOPPED = "stop"  # an end-of-sequence id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens
    FINISHED_ABORTED = "abort"  # its reader went away, or the process is exiting
    FINISHED_FAILED = "error"  # an error of its own: the reader gets it

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(frozen=True)
class Completion:
    """What a finished request reports (the result of `preheat.infer`, a choice of serve's)."""

    model: str
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str  # stop (end of sequence, a stop string) | length (max_tokens) | abort
    ttft_ms: float
    total_ms: float
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reuse_ms: float = 0.0  # lookup + id check + clone: what using the cache cost

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Piece:
    """A part of the answer as it is released: its text and its tokens' log probabilities."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


class Detokenizer:
    """The answer's text as its tokens come, with constant work per token (vLLM's incremental
    detokenizer): each step decodes only the tokens since the last released piece and a few
    before them, whose own text is subtracted, so a tokenizer that reads a token differently
    at the start of a text (sentencepiece's leading space) gives what one decode of the
    whole answer gives. A character split across tokens is held until it is complete."""

    def __init__(self, tokenizer, ids: list[int], start: int) -> None:
        self._tokenizer, self._ids = tokenizer, ids  # the request's own list: read, never written
        self._prefix = self._read = start

    def _decode(self, begin: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[begin:end], skip_special_tokens=True)

    def step(self) -> str:
        """The text the newest token completes ('' while a character is still open)."""
        before = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]

    def rest(self) -> str:
        """At the end: whatever is still held, an incomplete character included."""
        return self._decode(self._prefix)[len(self._decode(self._prefix, self._read)) :]


class AnswerText:
    """The text released to the reader. Text that may be the start of a stop string is held
    back; a stop string found (it starts in held text or in the new text, never in text
    already released) ends the answer before it."""

    def __init__(self, detokenizer: Detokenizer, stop: tuple[str, ...]) -> None:
        self._detokenizer, self._stop = detokenizer, stop
        self._held, self._logprobs = "", []
        self.released: list[str] = []
        self.stopped = False  # a stop string ended it

    def add(self, logprob: TokenLogprob | None) -> Piece | None:
        """The newest token's text (and log probability); the piece now safe to release."""
        if logprob is not None:
            self._logprobs.append(logprob)
        text = self._held + self._detokenizer.step()
        if (cut := first_stop(text, self._stop)) is not None:
            self.stopped = True
            return self._release(text[:cut], "", last=True)
        safe = len(text) - held_back(text, self._stop)
        return self._release(text[:safe], text[safe:], last=False)

    def finish(self) -> Piece | None:
        """At the end without a stop string: everything held is released."""
        return self._release(self._held + self._detokenizer.rest(), "", last=True)

    def _release(self, text: str, held: str, *, last: bool) -> Piece | None:
        """A piece of `text` (the last one also carries log probabilities with no text of
        their own: a special token's, say); None while there is nothing to release."""
        self._held = held
        if not text and not (last and self._logprobs):
            return None
        piece, self._logprobs = Piece(text, tuple(self._logprobs)), []
        self.released.append(text)
        return piece


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first stop string in `text` starts."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could begin a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


@dataclass(eq=False)
class Request:
    """One request's state. The scheduler's thread writes it; the reader gets what it
    releases through `out` (pieces, then the completion or the request's error)."""

    resident: ResidentModel
    prompt_ids: torch.Tensor  # [1, n], CPU
    sampling: SamplingParams
    use_cache: bool = True
    record: bool = True  # counted as cache traffic (probes are not)
    remember: bool = False  # the prompt and answer stay cached for a follow-up
    arrived: float = field(default_factory=time.perf_counter)  # TTFT counts from here
    on_first_token: Callable[[Request], None] | None = None
    adapter: object | None = None  # a LoraWeights: every token computed under it (engine/lora.py)
    status: RequestStatus = RequestStatus.WAITING
    ids: list[int] = field(init=False)  # the prompt's, then every token chosen: the one list
    prompt_tokens: int = field(init=False)
    sampler: Sampler = field(init=False, repr=False)
    answer: AnswerText = field(init=False, repr=False)
    logprobs: list[TokenLogprob] = field(init=False, default_factory=list, repr=False)
    cached_tokens: int = 0
    reuse_ms: float = 0.0
    ttft_ms: float = 0.0
    last_logits: torch.Tensor | None = field(init=False, default=None, repr=False)
    prompt_only: Prefix | None = field(init=False, default=None, repr=False)  # see `prefilled`
    out: queue.SimpleQueue = field(init=False, default_factory=queue.SimpleQueue, repr=False)
    cancelled: threading.Event = field(init=False, default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        vocab = self.resident.vocab_size
        if outside := [token for token, _ in self.sampling.logit_bias if token >= vocab]:
            raise SamplingError("logit_bias", f"token id {outside[0]} is not one of model {self.model}'s {vocab} ids")
        self.ids = self.prompt_ids[0].tolist()
        self.prompt_tokens = len(self.ids)
        defaults = ModelDefaults.of(self.resident.model)
        self.sampler = sampler_for(self.sampling, defaults, self.prompt_tokens, self.resident.placement.device)
        detokenizer = Detokenizer(self.resident.tokenizer, self.ids, self.prompt_tokens)
        self.answer = AnswerText(detokenizer, self.sampling.stop)

    @property
    def model(self) -> str:
        return self.resident.name

    @property
    def generated(self) -> int:
        return len(self.ids) - self.prompt_tokens

    def started(self, cached_tokens: int, reuse_ms: float) -> None:
        """It has a row: it starts from `cached_tokens` of a cached prefix, the rest of its
        prompt to compute."""
        self.cached_tokens, self.reuse_ms = cached_tokens, reuse_ms
        self.status = RequestStatus.PREFILLING

    def prefilled(self, logits: torch.Tensor, own_kv: Callable[[], object] | None) -> None:
        """Its prompt is computed: it decodes from here. A remembered turn keeps its
        prompt's own KV now where the answer's may not be cut back to it later (a sliding
        window that slides as the answer grows, or has already): see `to_remember`. `own_kv`
        makes it; None where the KV has no window (it can always be cut back: nothing kept)."""
        self.status = RequestStatus.RUNNING
        if self.remember and own_kv is not None:
            kv = own_kv()
            if has_window(kv) or not truncatable(kv):
                self.prompt_only = Prefix(clone_for_request(kv), logits.clone())

    def append_token(self, token: int, logprob: TokenLogprob | None, logits: torch.Tensor) -> bool:
        """Apply every per-token rule to the token its sampler chose (the runner's `sample`)
        from `logits` ([vocab]); True when the request is finished (its status says why)."""
        self.ids.append(token)
        self.last_logits = logits
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.generated == 1:
            self.ttft_ms = ms_since(self.arrived)
            if self.on_first_token is not None:
                self.on_first_token(self)
        if (piece := self.answer.add(logprob)) is not None:
            self.out.put(piece)
        if token in self.resident.stop_token_ids or self.answer.stopped:
            self.status = RequestStatus.FINISHED_STOPPED
        elif self.generated >= self.sampling.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
        elif self.cancelled.is_set():
            self.status = RequestStatus.FINISHED_ABORTED
        return self.status.finished

    def finish(self, status: RequestStatus | None = None) -> Completion:
        """Report the completion to the reader (the rest of the text first)."""
        if status is not None:
            self.status = status
        if not self.status.finished:
            raise RuntimeError(f"a {self.status.value} request cannot report a completion")
        released = self.answer.stopped or self.status is RequestStatus.FINISHED_ABORTED
        if not released and (piece := self.answer.finish()) is not None:
            self.out.put(piece)
        completion = Completion(
            model=self.model,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            token_ids=self.ids[self.prompt_tokens :],
            text="".join(self.answer.released),
            finish_reason=self.status.value,
            ttft_ms=self.ttft_ms,
            total_ms=ms_since(self.arrived),
            logprobs=list(self.logprobs),
            reuse_ms=self.reuse_ms,
        )
        self.out.put(completion)
        return completion

    def fail(self, error: Exception) -> None:
        self.status = RequestStatus.FINISHED_FAILED
        self.out.put(error)

    def to_remember(self, kv) -> tuple[list[int], Prefix] | None:
        """What stays cached once it is finished, with `remember`: its prompt and all but its
        last token (the one never fed), which a next turn can cut back to what it shares;
        where that cannot be cut (a window that slid), its prompt alone, as it was kept."""
        if not self.remember or self.status is RequestStatus.FINISHED_FAILED:
            return None
        if kv is not None and self.generated and (self.prompt_only is None or truncatable(kv)):
            return self.ids[:-1], Prefix(kv, self.last_logits.clone())
        if self.prompt_only is not None:
            return self.ids[: self.prompt_tokens], self.prompt_only
        return None

    def cancel(self) -> None:
        """The reader went away: the request ends at the scheduler's next step."""
        self.cancelled.set()


class TextStream:
    """What a caller reads: the answer's pieces as they are released, then `.completion`.
    Closing it (or leaving the loop early) ends the request: its row is freed at the next
    step."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self._completion: Completion | None = None
        self._error: BaseException | None = None

    def __iter__(self) -> Iterator[Piece]:
        try:
            while (item := self._next()) is not None:
                yield item
        finally:
            if self._completion is None and self._error is None:
                self._request.cancel()

    def _next(self) -> Piece | None:
        if self._completion is not None:
            return None
        if self._error is not None:
            raise self._error
        item = self._request.out.get()
        if isinstance(item, Completion):
            self._completion = item
            return None
        if isinstance(item, BaseException):
            self._error = item
            raise item
        return item

    @property
    def completion(self) -> Completion:
        """The final report; a stream closed early waits for its request's end (one step)."""
        while self._next() is not None:
            pass
        return self._completion

    def collect(self) -> Completion:
        return self.completion

    def close_after(self, pieces: int) -> None:
        """Read up to `pieces` pieces, then `close` (a first-call exercise's)."""
        for _ in zip(range(pieces), self, strict=False):
            pass
        self.close()

    def close(self) -> None:
        """Stop decoding now (the reader went away): what the request held is released."""
        if self._completion is None:
            self._request.cancel()


def ms_since(started: float) -> float:
    """Milliseconds from a time.perf_counter() reading to now."""
    return (time.perf_counter() - started) * 1000
