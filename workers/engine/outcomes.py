"""What becomes of a running request's token, its end and its failure: the one place the
scheduler's batches (`batch.Batch.step`) and its lone requests (`lone.LoneRequests`) hand
them to. Each token goes through the request's runner's sampler to `Request.append_token`,
which applies every per-token rule; a request that ends leaves what it keeps cached first.
Bookkeeping only: which rows run, and when, is the scheduler's.
"""

from __future__ import annotations

import logging

import torch

from preheat.workers.engine.prefixes import Prefixes
from preheat.workers.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


class Outcomes:
    def __init__(self, prefixes: Prefixes) -> None:
        self.prefixes = prefixes
        self.steps = 0  # decode steps run, and rows they fed: the mean batch size is their ratio
        self.rows_stepped = 0
        self.request_s = 1.0  # a moving average of how long a request runs, for Retry-After

    def append(self, request: Request, logits: torch.Tensor) -> bool:
        """One request's next token from its logits ([vocab]), by its runner; True: it leaves its row."""
        [choice] = request.resident.runner.sample([request], logits[None])
        return self.accept(request, choice, logits)

    def accept(self, request: Request, choice, logits: torch.Tensor) -> bool:
        """`Request.append_token`; a failure (its sampler's) ends the request with its error."""
        try:
            if isinstance(choice, Exception):
                raise choice
            return request.append_token(*choice, logits)
        except Exception as exc:
            self.fail(request, exc)
            return True

    def decoded(self, rows: int) -> None:
        if rows:
            self.steps, self.rows_stepped = self.steps + 1, self.rows_stepped + rows

    def finish(self, request: Request, kv, status: RequestStatus | None = None) -> None:
        """What it leaves cached first (a follow-up sent the moment the reader has the
        completion finds it), then the completion to the reader."""
        try:
            if (kept := request.to_remember(kv)) is not None:
                self.prefixes.remember(request.resident, *kept, adapter=request.adapter)
        finally:
            completion = request.finish(status)
            self.request_s = 0.9 * self.request_s + 0.1 * completion.total_ms / 1000

    @staticmethod
    def fail(request: Request, exc: Exception) -> None:
        log.warning("request on %s failed: %s", request.model, exc)
        request.fail(exc)
