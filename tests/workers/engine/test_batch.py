"""A batch's admission rule (BatchLimits.room_for): bookkeeping, tested without a model."""

from types import SimpleNamespace

from preheat.workers.engine.batch import BatchLimits

KV_PER_TOKEN = 1_000  # bytes a position of the model's KV takes


def _request(prompt_tokens: int, max_tokens: int, max_context: int = 0):
    resident = SimpleNamespace(kv_bytes_per_token=KV_PER_TOKEN, max_context=max_context)
    return SimpleNamespace(
        prompt_tokens=prompt_tokens, sampling=SimpleNamespace(max_tokens=max_tokens), resident=resident
    )


def test_a_row_joins_while_every_row_sized_as_the_longest_fits_the_kv_budget_and_the_cap():
    limits = BatchLimits(max_running=3, running_kv_bytes=3 * 100 * KV_PER_TOKEN)
    short, long = _request(60, 40), _request(140, 60)  # 100 and 200 positions
    assert limits.room_for(short, [short, short])  # 3 rows of 100
    assert not limits.room_for(short, [long])  # 2 rows of the longest, 200: 400 positions
    assert not limits.room_for(short, [short, short, short])  # the cap, whatever the KV
    assert limits.room_for(_request(10_000, 10), [])  # a model with nothing running takes one


def test_a_rows_need_stops_at_its_models_context():
    limits = BatchLimits(running_kv_bytes=2 * 100 * KV_PER_TOKEN)
    capped = _request(90, 500, max_context=100)  # 590 asked for, 100 possible
    assert limits.room_for(capped, [capped])
    assert not limits.room_for(_request(90, 500), [_request(90, 500)])
