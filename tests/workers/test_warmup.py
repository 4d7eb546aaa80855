"""The warmup verdict, with exact numbers: warm only when the probe used the cached prefix,
gave full prefill's token, is as fast as this worker's recent probes at its speed now, and
the worker is not several-fold slower than its recent self."""

import pytest

from preheat.workers.warmup import FirstToken, Probe, Recent, TemplateWarmup, median_of, side_by_side, verdict

PREFIX_TOKENS = 200


def _probe(warm_ms=6.0, bare_ms=5.0, warm_token=7, cached=PREFIX_TOKENS):
    warm = FirstToken(warm_token, warm_ms * 1.1, cached)  # the medians: recorded, not judged
    bare = FirstToken(7, bare_ms * 1.1, 0)
    cold = FirstToken(7, 40.0, 0)
    return Probe(bare=bare, cold=cold, warm=warm, warm_fastest_ms=warm_ms, bare_fastest_ms=bare_ms)


# This worker's recent probes of the prefix (fastest runs): warm 6 ms, bare 5 ms.
RECENT = Recent(warm_ms=(6.0, 6.2, 5.9, 6.1), bare_ms=(5.0, 5.1, 4.9, 5.1))


def _judge(probe, recent=RECENT, factor=3.0, steady_ms=None):
    result = TemplateWarmup(model="tiny", template="support", status="failed")
    verdict(result, probe, PREFIX_TOKENS, recent=recent, warm_factor=factor, steady_ms=steady_ms)
    return result


def test_a_busy_worker_is_warm_slowed_by_a_fraction_of_its_recent_self():
    busy = _judge(_probe(warm_ms=15.0, bare_ms=12.5), steady_ms=4.0)
    assert (busy.status, busy.error, busy.ttft_steady_ms) == ("warm", None, 4.0)
    assert (busy.ttft_warm_ms, busy.ttft_bare_ms) == pytest.approx((16.5, 13.75))  # the medians: what history records


def test_a_worker_slowed_several_fold_against_its_recent_self_is_degraded_with_the_numbers():
    throttled = _judge(_probe(warm_ms=30.0, bare_ms=25.0))
    assert throttled.status == "degraded"
    assert throttled.error == (
        "warm TTFT 30.0 ms (fastest run) is 5.0x this worker's recent self (6.0 ms, the median of its last 4 "
        "probes), over the warm factor 3"
    )
    bare_only = _judge(_probe(warm_ms=12.0, bare_ms=16.0))
    assert bare_only.status == "degraded" and bare_only.error.startswith("bare TTFT 16.0 ms (fastest run) is 3.2x")
    assert _judge(_probe(warm_ms=17.9, bare_ms=14.9)).status == "warm"  # within 3x: busy


def test_a_long_prefix_is_warm_at_any_length_held_to_its_own_probes():
    # A 3,000-token prefix: warm is 2.3x the no-system-prompt TTFT on a healthy worker. That
    # is attention over the cached tokens, not coldness: its own recent probes say so.
    long_recent = Recent(warm_ms=(11.5, 11.0, 12.0), bare_ms=(5.0, 4.8, 5.2))
    assert _judge(_probe(warm_ms=11.6, bare_ms=5.0), recent=long_recent).status == "warm"


def test_before_a_recent_self_a_probe_is_judged_by_the_cache_alone():
    first = _judge(_probe(warm_ms=30.0, bare_ms=25.0), recent=None)
    assert (first.status, first.error) == ("warm", None)


def test_a_probe_that_missed_the_cache_or_changed_the_token_is_degraded_however_fast():
    missed = _judge(_probe(cached=0))
    assert (missed.status, missed.error) == ("degraded", "the probe did not start from the cached prefix")
    changed = _judge(_probe(warm_token=9))
    assert changed.status == "degraded" and "differs from full prefill's 7" in changed.error


def test_side_by_side_interleaves_with_an_untimed_call_before_each_timed_one():
    calls = []

    def way(name):
        def measure():
            calls.append(name)
            return FirstToken(1, float(len(calls)), 0)

        return measure

    runs = side_by_side({"a": way("a"), "b": way("b")}, repeats=2)
    assert calls == ["a", "a", "b", "b", "a", "a", "b", "b"]
    assert [r.ms for r in runs["a"]] == [2.0, 6.0] and [r.ms for r in runs["b"]] == [4.0, 8.0]
    assert median_of(runs["a"]).ms == 4.0


def test_a_greedy_token_that_changes_between_identical_runs_is_an_error():
    with pytest.raises(RuntimeError, match="greedy first token changed"):
        median_of([FirstToken(1, 1.0, 0), FirstToken(2, 1.0, 0)])
