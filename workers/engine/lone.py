"""Requests that run by themselves, beside the batch: a request whose cache cannot run with the
others (layers written in place, or of other shapes), or a model whose attention is not
preheat's (a flash or eager implementation chosen at load). Each is a batch of one with its
own cache: its prompt a chunk an iteration (while the scheduler's prompt budget lasts), then a
token an iteration, between the batch's steps. A failure here is the request's alone.

The scheduler decides when each advances; what a token or an end means for the request is
`outcomes.Outcomes`'s: this is only the holders and their passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from preheat.workers.engine.outcomes import Outcomes
from preheat.workers.engine.request import Request, RequestStatus


@dataclass(eq=False)
class _Decoding:
    request: Request
    kv: object


@dataclass(eq=False)
class _Prefilling:
    request: Request
    kv: object
    feed: torch.Tensor  # the ids still to compute, [1, n]


class LoneRequests:
    def __init__(self, outcomes: Outcomes) -> None:
        self._outcomes = outcomes
        self._decoding: list[_Decoding] = []
        self._prefilling: list[_Prefilling] = []

    def requests(self) -> list[Request]:
        return [p.request for p in self._prefilling] + [d.request for d in self._decoding]

    def start(self, request: Request, start, prompt_budget: int) -> None:
        """A request that runs by itself from `start` (preheat.workers.engine.prefixes.Start)."""
        try:
            if start.logits is not None:
                self._first_token(request, start.logits, start.cache)
                return
            prefilling = _Prefilling(request, start.cache, start.feed_ids)
            if not self._advance(prefilling, prompt_budget):
                self._prefilling.append(prefilling)
        except Exception as exc:
            self._outcomes.fail(request, exc)

    def continue_prefills(self, budget: int) -> int:
        """Each prompt running alone gets its next chunk, while the budget lasts; returns what
        is left of it."""
        under_way = []
        for prefilling in self._prefilling:
            if prefilling.request.cancelled.is_set():
                self._outcomes.finish(prefilling.request, None, RequestStatus.FINISHED_ABORTED)
            elif budget <= 0:
                under_way.append(prefilling)
            else:
                chunk = min(budget, int(prefilling.feed.shape[-1]))
                budget -= chunk
                try:
                    if not self._advance(prefilling, chunk):
                        under_way.append(prefilling)
                except Exception as exc:
                    self._outcomes.fail(prefilling.request, exc)
        self._prefilling = under_way
        return budget

    def step_all(self) -> None:
        """A token for each decoding request."""
        for decoding in list(self._decoding):
            request = decoding.request
            done = request.cancelled.is_set()
            if not done:
                try:
                    token = torch.tensor([[request.ids[-1]]])
                    logits, decoding.kv = request.resident.runner.forward(token, decoding.kv, request.adapter)
                    self._outcomes.decoded(1)
                except Exception as exc:
                    self._decoding.remove(decoding)
                    self._outcomes.fail(request, exc)
                    continue
                done = self._outcomes.append(request, logits)
            if done:
                self._decoding.remove(decoding)
                if request.status is not RequestStatus.FINISHED_FAILED:
                    aborted = None if request.status.finished else RequestStatus.FINISHED_ABORTED
                    self._outcomes.finish(request, decoding.kv, aborted)

    def take_all(self) -> list[Request]:
        """Every request held, no longer held (they end with the caller's error)."""
        requests, self._prefilling, self._decoding = self.requests(), [], []
        return requests

    def _advance(self, prefilling: _Prefilling, tokens: int) -> bool:
        """The next `tokens` ids of its prompt; True once its first token is chosen."""
        piece, prefilling.feed = prefilling.feed[:, :tokens], prefilling.feed[:, tokens:]
        logits, prefilling.kv = prefilling.request.resident.runner.forward(
            piece, prefilling.kv, prefilling.request.adapter
        )
        if prefilling.feed.shape[-1]:
            return False
        self._first_token(prefilling.request, logits, prefilling.kv)
        return True

    def _first_token(self, request: Request, logits: torch.Tensor, kv) -> None:
        request.prefilled(logits, lambda: kv)
        if self._outcomes.append(request, logits):
            if request.status is not RequestStatus.FINISHED_FAILED:
                self._outcomes.finish(request, kv)
        else:
            self._decoding.append(_Decoding(request, kv))
