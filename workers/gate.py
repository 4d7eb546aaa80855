"""When a warm model takes requests: the gate between warming and serving (RequestGate)."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class RequestGate:
    """When a warm model takes requests. Once every template of a model is warm, the model
    is announced (`on_model_warm`): a worker then consumes its inference queue, `preheat
    serve` opens it. A gated process is ready only once it takes the model's requests
    (`taking`): Kubernetes routes to a ready pod, so ready and taking requests must be the
    same moment."""

    def __init__(self) -> None:
        self.gated = False
        self.on_model_warm: Callable[[str], None] | None = None
        # Called when a model goes to sleep: the process stops taking its requests.
        self.on_model_sleep: Callable[[str], None] | None = None
        self._announced: set[str] = set()
        self._taking: set[str] = set()

    def warm(self, model: str) -> None:
        if model not in self._announced and self.on_model_warm is not None:
            self._announced.add(model)
            self.on_model_warm(model)

    def taking(self, model: str) -> None:
        self._taking.add(model)
        log.info("model %s takes requests", model)

    def sleeping(self, model: str) -> None:
        """`model` goes to sleep: no more of its requests taken; once awake and warm it is
        announced again."""
        self._announced.discard(model)
        self._taking.discard(model)
        if self.on_model_sleep is not None:
            self.on_model_sleep(model)

    def failed(self, model: str) -> None:
        """`model` could not wake: its requests are taken again, each answered at once with
        the reason (WorkerRuntime refuses them), instead of waiting for a wake that will not
        come. Readiness keeps saying why."""
        self._taking.discard(model)
        self._announced.add(model)
        if self.on_model_warm is not None:
            self.on_model_warm(model)

    def serving(self, models: list[str]) -> list[str]:
        """Of `models`, those whose requests this process takes now."""
        return [model for model in models if (model in self._taking if self.gated else model in self._announced)]

    def reason(self, model: str) -> str | None:
        if self.gated and model not in self._taking:
            return f"model {model}: warm, not taking requests yet"
        return None
