"""Who wakes for a request that meets a sleeping model: one worker of the fleet, not all."""

from preheat.fleet.sleep import first_sleeper
from preheat.history.db import session_scope, utcnow
from preheat.history.models import WorkerRecord


def _worker(name: str, *, asleep: bool, model: str = "tiny") -> WorkerRecord:
    now = utcnow()
    state = {
        "models": {} if asleep else {model: {"device": "cpu/float32"}},
        "asleep": {model: {"level": 1}} if asleep else {},
    }
    return WorkerRecord(
        nodename=name, hostname="h", pid=1, started_at=now, heartbeat_at=now, ready=not asleep, state=state
    )


def test_the_first_live_sleeper_by_name_wakes_and_none_while_one_is_awake(embedded_stack):
    with session_scope() as session:
        session.add_all([_worker("b@h", asleep=True), _worker("c@h", asleep=True)])
    assert first_sleeper("tiny", "c@h", 45) == "b@h"  # c waits: b wakes
    assert first_sleeper("tiny", "b@h", 45) == "b@h"
    assert first_sleeper("tiny", "a@h", 45) == "a@h"  # a newcomer first by name wakes itself
    with session_scope() as session:
        session.add(_worker("d@h", asleep=False))
    assert first_sleeper("tiny", "b@h", 45) is None  # d is awake and takes the request
    assert first_sleeper("other", "b@h", 45) == "b@h"  # d does not hold that model awake
