"""The decode steps CUDA graphs replay (preheat.workers.engine.cudagraphs), run directly on the
CPU: the same tokens as transformers in float32, several rows at once through the scheduler;
a batch that outgrew the buffers the graphs read runs without them, still right; a model with
sliding-window layers has none. The capture itself needs a GPU: tests/gpu_check.py."""

from __future__ import annotations

import pytest

from preheat.workers.engine.batch import BatchLimits
from tests.conftest import answers_together, greedy, new_scheduler, reference_generate, support_request

INPUTS = ("Where is my parcel?", "Summarise: the launch moved to March.", "Hello", "Is it raining in Oslo today?")


def _float32(dev_model, arch: str):
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    return ResidentModels("cpu", dtype_preference="float32").ensure(ModelSource(arch, str(dev_model(arch))))[0]


def _static(scheduler, resident, limits: BatchLimits):
    """The runner's decode steps over static buffers sized by `limits`, run directly."""
    runner = resident.runner
    runner.decode_graphs = scheduler.call(runner.static_decode, limits)
    return runner.decode_graphs


@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_static_decode_steps_give_transformers_tokens_rows_together(dev_model, arch):
    resident = _float32(dev_model, arch)
    scheduler = new_scheduler()
    try:
        graphs = _static(scheduler, resident, BatchLimits(max_running=6))
        assert graphs.sizes == [1, 2, 4]  # the largest size within max_running, a spare slot beside
        requests = [(support_request(resident, text)[1], greedy(12)) for text in INPUTS]
        together = answers_together(scheduler, resident, requests)
        alone = [scheduler.submit(resident, *request).collect() for request in requests]
    finally:
        resident.runner.decode_graphs = None
        scheduler.close()
    assert graphs.steps_run[4] > 0 and graphs.steps_run[1] > 0  # padded to 4 together, 1 alone
    for (ids, _), batched, single in zip(requests, together, alone, strict=True):
        expected = reference_generate(resident, ids, 12)
        assert batched.token_ids == single.token_ids == expected[: len(batched.token_ids)]


def test_a_batch_grown_past_the_reserved_buffers_decodes_without_them(dev_model):
    resident = _float32(dev_model, "llama")
    scheduler = new_scheduler()
    try:
        # A KV budget of 48 positions a slot: a support prompt and 40 tokens outgrow it.
        limits = BatchLimits(max_running=2, running_kv_bytes=3 * 48 * resident.kv_bytes_per_token)
        graphs = _static(scheduler, resident, limits)
        columns = graphs.reserved[1][1]
        ids = support_request(resident, INPUTS[0])[1]
        assert ids.shape[-1] + 40 > columns
        answer = scheduler.submit(resident, ids, greedy(40)).collect()
    finally:
        resident.runner.decode_graphs = None
        scheduler.close()
    assert sum(graphs.steps_run.values()) == 0  # every step ran on the batch's own, grown buffers
    assert answer.token_ids == reference_generate(resident, ids, 40)[: len(answer.token_ids)]


def test_a_model_with_sliding_window_layers_has_no_static_decode(dev_model):
    resident = _float32(dev_model, "gemma3")
    scheduler = new_scheduler()
    try:
        with pytest.raises(ValueError, match="sliding-window"):
            scheduler.call(resident.runner.static_decode, BatchLimits())
    finally:
        scheduler.close()
