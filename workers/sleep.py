"""A model asleep: its KV freed, its weights off the device, and back again on wake.

vLLM's levels, on preheat's workers:

- **Level 1** keeps the model object (classes, config, tokenizer, resolved templates) and
  takes the weights off the device. On CUDA they go to pinned host memory and are copied
  back on wake. On the CPU there is no "off the device": the weights are released and read
  again on wake from the model's own safetensors files, each tensor by its name. What comes
  back from disk is untrusted: the model's content digest (taken at load) must come out the
  same, else the wake reloads through the weight loader.
- **Level 2** drops the model, weights and all; wake loads it again through the weight
  loader (`ResidentModels.ensure`), as a cold start would, minus the process.

Either way the model's KV cache entries are freed (pinned prefixes stay in the prefix store,
so a wake restores them rather than computing them), and the scheduler holds the model
parked: it takes no request for it until woken. This module is the weights' part and the
bookkeeping; `Sleeps` below orders a sleep and a wake against requests and warmups.
"""

from __future__ import annotations

import datetime as dt
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from preheat.core.errors import ModelLoadError
from preheat.workers.engine.device import synchronize
from preheat.workers.engine.kvtensors import release_free_heap
from preheat.workers.engine.openmp import team_released
from preheat.workers.engine.resident import LOADING, ModelSource, ResidentModel, ResidentModels, digest_contents
from preheat.workers.engine.scheduler import SleepRefused
from preheat.workers.engine.weights import load_weights, read_by_name, unique_parameters

log = logging.getLogger(__name__)

LEVELS = (1, 2)


# Weights -----------------------------------------------------------------------------


def weight_bytes(model) -> int:
    """Bytes the model's parameters hold (each storage once)."""
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for _, p in unique_parameters(model).values()
    }
    return sum(storages.values())


@dataclass
class Offloaded:
    """What level 1 took off one model: each parameter's shape and dtype, and on CUDA its
    copy in pinned host memory (None on the CPU: the files are the copy)."""

    shapes: dict[int, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    host: dict[int, torch.Tensor] | None = None


def offload_weights(resident: ResidentModel) -> tuple[Offloaded, int]:
    """Level 1: each parameter's storage off the device (see the module's docstring);
    returns what a wake needs and the bytes released from the device."""
    model, device = resident.model, resident.placement.device
    freed = weight_bytes(model)
    offloaded = Offloaded(host={} if device.type == "cuda" else None)
    for key, (_, parameter) in unique_parameters(model).items():
        offloaded.shapes[key] = (parameter.shape, parameter.dtype)
        if offloaded.host is not None:
            host = torch.empty(parameter.shape, dtype=parameter.dtype, pin_memory=True)
            host.copy_(parameter.data)
            offloaded.host[key] = host
        parameter.data = torch.empty(0, dtype=parameter.dtype, device=device)
    _give_back(device)
    return offloaded, freed


def restore_weights(resident: ResidentModel, offloaded: Offloaded) -> None:
    """Level 1's wake: the parameters back on the device, from pinned host memory (CUDA) or
    the model's safetensors files (CPU), then proven by the content digest."""
    model, device = resident.model, resident.placement.device
    parameters = unique_parameters(model)
    if offloaded.host is not None:
        for key, (_, parameter) in parameters.items():
            parameter.data = offloaded.host[key].to(device, non_blocking=True)
        synchronize(device)
    else:
        read_by_name(resident.path, parameters, offloaded.shapes, ModelLoadError)
    _prove(resident)


def reload_into(resident: ResidentModel, source: ModelSource, loader: str) -> None:
    """Level 1's fallback on the CPU: the weights through the weight loader (whatever names
    or conversions the checkpoint needs), taken into the sleeping model by name."""
    with LOADING:  # one model built at a time in a process (see resident.LOADING)
        fresh, _ = load_weights(
            source.path, resident.placement, loader, {}, {"revision": source.revision} if source.revision else {}
        )
    state = dict(fresh.named_parameters(remove_duplicate=False))
    for name, parameter in resident.model.named_parameters(remove_duplicate=False):
        parameter.data = state[name].data.to(resident.placement.device)
    _prove(resident)


class WeightsChanged(ModelLoadError):
    """The weights read back are not the ones the model slept with."""


def _prove(resident: ResidentModel) -> None:
    """The weights back are the ones the model slept with: its content digest, taken at load."""
    if digest_contents(resident.model) != resident.content_digest:
        raise WeightsChanged(
            f"model {resident.name}: the weights read back from {resident.path} are not the ones it slept with "
            "(the files changed while it slept)"
        )


def _give_back(device: torch.device) -> None:
    """Freed storage returned to the system now: the CUDA caching allocator's blocks, or the
    CPU heap's free pages (glibc keeps them resident otherwise)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    release_free_heap()


def resident_set_bytes(pid: int | str = "self") -> int:
    """A process's resident set (this one's by default), from /proc (0 where there is none)."""
    import os

    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


# What a sleep or a wake measured: the history job's columns -------------------------------


@dataclass
class SleepResult:
    model: str
    status: str  # asleep | skipped | failed
    sleep_level: int
    sleep_ms: float | None = None
    bytes_freed: int | None = None  # KV and weights, as counted (exact storage bytes)
    cache_bytes: int | None = None  # of which KV
    device: str | None = None
    error: str | None = None

    def as_record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "model"}


@dataclass
class WakeResult:
    model: str
    status: str  # awake | skipped | failed
    sleep_level: int | None = None
    wake_ms: float | None = None
    load_ms: float | None = None  # level 2: the load through the weight loader
    compile_source: str | None = None  # its steps: compiled | restored (compile store) | kept (level 1) | eager
    compile_ms: float | None = None
    device: str | None = None
    error: str | None = None

    def as_record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "model"}


@dataclass
class Asleep:
    level: int
    since: float  # time.time()
    offloaded: Offloaded | None = None  # level 1; level 2 holds nothing

    def describe(self) -> dict:
        return {"level": self.level, "since": self.since}


class Sleeps:
    """Which models sleep in this process, and the two moves. A sleep takes the warmups'
    lock (it never starts while a warmup of the model runs), tells the gate first (the
    worker stops taking the model's requests, readiness says `asleep`), then waits for the
    model's running and waiting requests to finish, up to `drain_s`: past that it is
    refused and everything is as before; no request is ever cut. A wake puts the weights
    back and unparks the model; its templates are then warmed by the caller (a wake is a
    warmup), or pre-filled at once when a request is waiting for it (`ensure_awake`)."""

    def __init__(
        self,
        resident_models: ResidentModels,
        scheduler,
        source_of: Callable[[str], ModelSource],
        lock: threading.RLock,
        *,
        on_sleep: Callable[[str], None],
        on_wake: Callable[[str], None],
        on_failed: Callable[[str], None],
        forget_prefixes: Callable[[str], None],
        restore_prefixes: Callable[[str], None],
        drain_s: float = 30.0,
    ) -> None:
        """`on_sleep` / `on_wake` tell the gate (the model's requests stop, and are taken again
        once it is warm); `on_failed` too, when a wake failed (its requests are taken, to be
        answered with the reason at once, not left waiting); `forget_prefixes` marks the
        model's templates not ready (their KV is freed), `restore_prefixes` restores (or
        pre-fills) and pins them again."""
        self._models, self._scheduler, self._source_of, self.lock = resident_models, scheduler, source_of, lock
        self._on_sleep, self._on_wake, self._on_failed, self.drain_s = on_sleep, on_wake, on_failed, drain_s
        self._forget_prefixes, self._restore_prefixes = forget_prefixes, restore_prefixes
        self.asleep: dict[str, Asleep] = {}
        # Models whose wake failed, and why: nothing of them is held; a request for one is
        # refused with the reason at once, and only a wake (an admin's, a schedule's) tries again.
        self.failed: dict[str, str] = {}
        self.wakes_on_demand = 0
        # Told of each wake a request made here (`ensure_awake`: model, WakeResult, when it
        # began), whatever its outcome: the worker records it in history as a run of its own.
        self.on_demand_wake: Callable[[str, WakeResult, dt.datetime], None] | None = None

    def level_of(self, model: str) -> int | None:
        state = self.asleep.get(model)
        return state.level if state else None

    @team_released()  # weights copied on a task's or a request's thread, which lives on
    def sleep(self, model: str, level: int = 1) -> SleepResult:
        """Never raises for a model that cannot sleep: the failure is the record. Pinned
        prefixes are written to the prefix store first (those under way), so a wake restores
        them."""
        result = SleepResult(model, "failed", level)
        if level not in LEVELS:
            result.error = f"sleep level must be 1 or 2, got {level}"
            return result
        with self.lock:
            if model in self.asleep:
                result.status, result.error = "skipped", f"already asleep (level {self.asleep[model].level})"
                return result
            resident = self._models.get(model)
            if resident is None:
                result.error = f"model {model} is not resident here"
                return result
            result.device = resident.placement.describe()
            started = time.perf_counter()
            if (store := self._scheduler.prefixes.store) is not None:
                store.flush()
            self._on_sleep(model)  # no new request from the queue; readiness says why
            try:
                kv_bytes = self._scheduler.park(resident.name, self.drain_s)
            except SleepRefused as exc:
                self._on_wake(model)
                result.error = str(exc)
                return result
            try:
                result.cache_bytes, weights = kv_bytes, self._release(resident, level)
            except Exception as exc:  # the weights stay: the model is woken as it was
                log.exception("model %s could not sleep", model)
                self._scheduler.unpark(model)
                self._on_wake(model)
                result.error = f"{type(exc).__name__}: {exc}"
                return result
            result.bytes_freed = kv_bytes + weights
            result.sleep_ms = (time.perf_counter() - started) * 1000
            result.status = "asleep"
            self._forget_prefixes(model)
            log.info(
                "model %s asleep (level %d) after %.0f ms: %d bytes freed",
                model,
                level,
                result.sleep_ms,
                result.bytes_freed,
            )
            return result

    def _release(self, resident: ResidentModel, level: int) -> int:
        if level == 1:
            resident.runner.suspend()  # the packed weights go; the graphs stay, for the wake
            offloaded, freed = offload_weights(resident)
            self.asleep[resident.name] = Asleep(1, time.time(), offloaded)
            return freed
        resident.runner.release()  # its compiled steps and packed weights: compiled again on wake
        freed = weight_bytes(resident.model)
        self._models.drop(resident.name)
        for _, parameter in unique_parameters(resident.model).values():  # whoever still holds the object
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
        self.asleep[resident.name] = Asleep(2, time.time())
        _give_back(resident.placement.device)
        return freed

    def start_asleep(self, models: dict[str, str]) -> None:
        """Before start-up loads anything: `models` (model -> why) start asleep, nothing
        loaded (the rule is preheat.fleet.sleep's); a wake or a request loads them, as after
        level 2."""
        for model, why in models.items():
            self.asleep[model] = Asleep(2, time.time())
            self._scheduler.unpark(model)  # nothing to park: no request was ever taken
            self._forget_prefixes(model)
            log.info("model %s starts asleep: %s", model, why)

    @team_released()
    def wake(self, model: str) -> WakeResult:
        """The weights back, the model unparked, and every template restored (or pre-filled)
        and pinned: the model takes requests again, as after start-up. The caller's warmups
        then probe and judge each template (a wake is a warmup), as start-up's first job
        does. Never raises: the failure is the record."""
        result = WakeResult(model, "failed")
        with self.lock:
            state = self.asleep.get(model)
            if state is None and model in self.failed:
                state = Asleep(2, time.time())  # a failed wake left nothing: load it again
            if state is None:
                result.status, result.error = "skipped", "awake already"
                return result
            result.sleep_level = state.level
            started = time.perf_counter()
            try:
                resident = self._restore(model, state, result)
            except Exception as exc:
                result.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ModelLoadError) else str(exc)
                self._fail(model, result.error)
                return result
            self.asleep.pop(model, None)
            self.failed.pop(model, None)
            self._scheduler.unpark(model)
            result.wake_ms = (time.perf_counter() - started) * 1000
            result.device, result.status = resident.placement.describe(), "awake"
            log.info("model %s awake (level %d) after %.0f ms", model, state.level, result.wake_ms)
            self._restore_prefixes(model)
            if (report := resident.runner.compile_report) is not None:
                result.compile_source, result.compile_ms = report.source, report.ms
            self._on_wake(model)
            return result

    def _fail(self, model: str, reason: str) -> None:
        """A wake that failed: what it read is let go (never served, nor held beside nothing),
        the model marked failed with the reason, and its waiting requests answered with it."""
        log.warning("model %s could not wake: %s", model, reason)
        rejected = self._models.drop(model)
        if rejected is not None:
            rejected.runner.release()
            for _, parameter in unique_parameters(rejected.model).values():
                parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
            _give_back(rejected.placement.device)
        self.asleep.pop(model, None)
        self.failed[model] = reason
        self._on_failed(model)

    def _restore(self, model: str, state: Asleep, result: WakeResult) -> ResidentModel:
        if state.level == 2:
            resident, result.load_ms = self._models.ensure(self._source_of(model))
            return resident
        resident = self._models.get(model)
        try:
            restore_weights(resident, state.offloaded)
        except WeightsChanged:
            raise  # read once: reading them again through the loader would read the same change
        except ModelLoadError as exc:
            if state.offloaded.host is not None:
                raise
            log.warning("%s; reading the weights through the loader", exc)
            reload_into(resident, self._source_of(model), resident.weight_loader)
        return resident

    def ensure_awake(self, model: str) -> bool:
        """Wake `model` if it sleeps (a request is waiting for it here); True if it did. A
        model whose wake failed is refused with the reason, never read again for a request."""
        if (reason := self.failed.get(model)) is not None:
            raise ModelLoadError(f"model {model} could not wake: {reason}")
        if model not in self.asleep:
            return False
        with self.lock:
            if model not in self.asleep:
                return False
            began = dt.datetime.now(dt.UTC)
            result = self.wake(model)
        if self.on_demand_wake is not None:
            try:
                self.on_demand_wake(model, result, began)
            except Exception as exc:  # the record is the history's; the request goes on
                log.warning("model %s: its wake on demand is not recorded (%s)", model, exc)
        if result.status != "awake":
            raise ModelLoadError(f"model {model} could not wake: {result.error}")
        self.wakes_on_demand += 1
        log.info("model %s woken on demand", model)
        return True
