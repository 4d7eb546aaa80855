"""The warmup verdict, with exact numbers: warm only when the probe used the cached prefix,
gave full prefill's token, and was as fast as the worker's steady state."""

import pytest

from workers.warmup import FirstToken, Probe, TemplateWarmup, median_of, side_by_side, verdict

PREFIX_TOKENS = 200


def _probe(warm_ms=6.0, bare_ms=5.0, warm_token=7, cached=PREFIX_TOKENS, fastest_ms=None):
    return Probe(
        bare=FirstToken(7, bare_ms, 0),
        cold=FirstToken(7, 40.0, 0),
        warm=FirstToken(warm_token, warm_ms, cached),
        warm_fastest_ms=fastest_ms,
    )


def _judge(probe, steady_ms=None, factor=1.5, best_ms=None):
    result = TemplateWarmup(model="tiny", template="support", status="failed")
    verdict(result, probe, PREFIX_TOKENS, steady_ms=steady_ms, warm_factor=factor, best_ms=best_ms)
    return result


def test_warm_within_the_factor_of_steady_state():
    result = _judge(_probe(warm_ms=7.4), steady_ms=5.0)
    assert (result.status, result.error, result.ttft_steady_ms) == ("warm", None, 5.0)


def test_degraded_over_the_factor_of_steady_state_with_the_numbers():
    result = _judge(_probe(warm_ms=7.6), steady_ms=5.0)
    assert result.status == "degraded"
    assert result.error == "warm TTFT 7.6 ms is 1.52x the steady state 5.0 ms, over the warm factor 1.5"


def test_a_long_prefix_is_warm_at_any_length_against_the_workers_own_warm_figures():
    # A 3,000-token prefix: warm is 2.3x the no-system-prompt TTFT on a healthy worker. That
    # is attention over the cached tokens, not coldness: held to its own warm runs, it is warm.
    healthy = _judge(_probe(warm_ms=11.5, bare_ms=5.0, fastest_ms=10.9))
    assert (healthy.status, healthy.error, healthy.ttft_steady_ms) == ("warm", None, None)
    # Later, the same worker slowed several-fold: held to its best earlier warm probe.
    throttled = _judge(_probe(warm_ms=60.0, bare_ms=26.0, fastest_ms=52.0), best_ms=10.9)
    assert throttled.status == "degraded"
    assert throttled.error == (
        "warm TTFT 60.0 ms is 5.50x the best warm TTFT this worker measured 10.9 ms, over the warm factor 1.5"
    )
    # Throttled in turn (a CPU quota): the median run far slower than the fastest.
    stalling = _judge(_probe(warm_ms=40.0, fastest_ms=11.0))
    assert stalling.status == "degraded" and "the fastest warm probe run 11.0 ms" in stalling.error


def test_the_reference_is_the_fastest_of_the_workers_own_figures():
    from workers.warmup import reference_ttft

    probe = _probe(warm_ms=12.0, fastest_ms=11.0)
    assert reference_ttft(probe, steady_ms=None, best_ms=None) == (11.0, "fastest warm probe run")
    assert reference_ttft(probe, steady_ms=9.0, best_ms=10.0) == (9.0, "steady state")
    assert reference_ttft(probe, steady_ms=13.0, best_ms=10.0) == (10.0, "best warm TTFT this worker measured")
    assert reference_ttft(_probe(warm_ms=12.0), steady_ms=None, best_ms=None) == (12.0, "warm TTFT")


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
