"""Idle work on the scheduler's thread (preheat.workers.engine.sidework), through the real
scheduler and a real dev model: it waits for the moments between requests, takes its share
beside traffic that never pauses, never holds a stop, and a failing piece drops its work."""

from __future__ import annotations

import itertools
import threading
import time

from tests.conftest import greedy, load_resident, new_scheduler, reference_generate, support_request


class IdleWorkPieces:
    """A runner's part the scheduler sees at a compile (`compile`, `idle_work`), whose idle
    work is `count` pieces (endless where None): each records when it ran and whether a
    request held a row meanwhile."""

    name = "pieces"

    def __init__(self, scheduler, count: int | None = None) -> None:
        self.scheduler, self.count = scheduler, count
        self.ran: list[tuple[float, float, bool]] = []  # (started, ended, beside a request)

    @property
    def pieces(self) -> int:
        return len(self.ran)

    def compile(self, *args):
        return None

    def idle_work(self):
        return self.piece

    def piece(self) -> bool:
        started = time.monotonic()
        beside = self.scheduler.load()["running"] > 0
        time.sleep(0.002)
        self.ran.append((started, time.monotonic(), beside))
        return self.count is None or self.pieces < self.count

    def beside_requests(self) -> list[tuple[float, float, bool]]:
        return [piece for piece in self.ran if piece[2]]


def test_idle_work_waits_for_the_moments_between_requests_and_never_holds_a_stop(dev_model):
    """Idle work (a model's weights packed: sidework.IdleWork) runs a piece an iteration while
    no request holds a row; requests that leave such a moment within STARVED_AFTER_S never
    have a piece run beside them, and answer as transformers; a stop completes with idle work
    still left."""
    resident = load_resident(dev_model("llama"), name="llama")
    scheduler = new_scheduler()
    endless = IdleWorkPieces(scheduler)
    scheduler.compile(endless, "off", None, "")
    deadline = time.monotonic() + 30
    while endless.pieces < 3:
        assert time.monotonic() < deadline, "no idle work ran on an idle scheduler"
        time.sleep(0.005)
    prompt_ids = support_request(resident, "Where is my parcel?")[1]
    answers = [scheduler.submit(resident, prompt_ids, greedy(6)) for _ in range(3)]
    answers = [answer.collect() for answer in answers]
    before = endless.pieces
    while endless.pieces <= before:  # idle again: the pieces go on
        assert time.monotonic() < deadline, "idle work did not go on after the requests"
        time.sleep(0.005)
    scheduler.close(timeout_s=10)
    assert scheduler._thread is None  # the stop completed, the endless work left undone
    assert endless.beside_requests() == []
    truth = reference_generate(resident, prompt_ids, 6)
    assert all(answer.token_ids == truth[: len(answer.token_ids)] for answer in answers)


def test_idle_work_finishes_under_traffic_that_never_pauses(dev_model, monkeypatch):
    """Requests that leave no idle moment for STARVED_AFTER_S (a backlog at ready) still leave
    idle work its share: a model's weights get packed under steady traffic, a piece beside the
    requests once the last one's time is paid back (SHARE_BESIDE_REQUESTS)."""
    from preheat.workers.engine import sidework

    monkeypatch.setattr(sidework, "STARVED_AFTER_S", 0.1)  # the dev model's requests are short
    resident = load_resident(dev_model("llama"), name="llama")
    scheduler = new_scheduler()
    work = IdleWorkPieces(scheduler, count=4)
    prompt_ids = support_request(resident, "Where is my parcel?")[1]
    running = [scheduler.submit(resident, prompt_ids, greedy(400)) for _ in range(2)]
    deadline = time.monotonic() + 60
    while scheduler.load()["running"] < 2:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.005)
    queued = time.monotonic()
    scheduler.compile(work, "off", None, "")  # its idle work queued while both requests run
    try:
        while work.pieces < 4 and scheduler.load()["running"] == 2:
            time.sleep(0.005)
        assert work.pieces == 4 and len(work.beside_requests()) == 4, work.ran
        assert work.ran[0][0] - queued >= sidework.STARVED_AFTER_S
        # A row is held only on the scheduler's thread: a piece beside one ran while it was busy.
        for (started, ended, _), (next_started, _, _) in itertools.pairwise(work.ran):
            assert next_started - ended >= (ended - started) * (1 / sidework.SHARE_BESIDE_REQUESTS - 1)
    finally:
        for answer in running:
            answer.close()
        scheduler.close(timeout_s=10)


def test_a_failing_piece_of_idle_work_is_dropped_and_logged(caplog):
    """Idle work is speed, never an answer: a piece that raises drops its model's work, logged once."""
    from preheat.workers.engine.sidework import IdleWork

    class Broken:
        name = "broken"

        def idle_work(self):
            return self.piece

        def piece(self) -> bool:
            raise RuntimeError("cannot allocate memory")

    idle = IdleWork()
    idle.add(Broken())
    assert idle
    idle.run_piece(*idle.next_piece(), threading.Lock())
    assert not idle and "model broken: its idle work failed and is dropped" in caplog.text
