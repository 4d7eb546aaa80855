"""WorkerRuntime: a template warmed on this process, without Celery."""

import pytest

from preheat.catalog import load_catalog
from tests.conftest import write_catalog
from workers.warmup import WorkerRuntime


@pytest.fixture
def runtime(tmp_path, tiny_model):
    extra = (
        '\n[models.gone]\npath = "does/not/exist"\n'
        '[templates.orphan]\nmodel = "gone"\nsystem_prompt = "You are lost."\n'
    )
    return WorkerRuntime(load_catalog(write_catalog(tmp_path, tiny_model, extra)), "cpu", probe_repeats=2)


def test_first_warmup_loads_and_prefills_then_reuses_both(runtime):
    first = runtime.warm_template("support")
    assert first.status == "warm", first.error
    assert first.load_ms > 0 and first.prefill_ms > 0
    assert first.ttft_cold_ms > 0 and first.ttft_warm_ms > 0 and first.ttft_bare_ms > 0
    assert first.cached_tokens > 20 and first.cache_bytes > 0 and first.device == "cpu/float32"

    again = runtime.warm_template("support")
    assert again.status == "warm"
    assert (again.load_ms, again.prefill_ms) == (0.0, 0.0)  # resident model, cached prefix
    assert (again.cached_tokens, again.cache_bytes) == (first.cached_tokens, first.cache_bytes)


def test_a_changed_system_prompt_is_prefilled_again(runtime):
    runtime.warm_template("support")
    old = runtime.prefixes[("tiny", "support")]
    runtime.catalog = runtime.catalog.model_copy(update={"templates": {
        **runtime.catalog.templates,
        "support": runtime.catalog.templates["support"].model_copy(update={"system_prompt": "Be brief."}),
    }})
    result = runtime.warm_template("support")
    assert result.prefill_ms > 0 and result.cached_tokens < old.num_tokens


def test_a_missing_model_fails_the_job_and_the_runtime_keeps_serving(runtime):
    broken = runtime.warm_template("orphan")
    assert broken.status == "failed"
    assert "model 'gone' failed to load from" in broken.error and "does/not/exist" in broken.error
    assert runtime.registry.unavailable.keys() == {"gone"}
    assert runtime.warm_template("support").status == "warm"


def test_an_unknown_template_is_a_failed_result_not_an_exception(runtime):
    result = runtime.warm_template("nope")
    assert result.status == "failed" and "unknown template 'nope'" in result.error


def test_truncated_weights_fail_with_the_loader_error(tmp_path, tiny_model):
    import shutil

    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    catalog = load_catalog(write_catalog(tmp_path, corrupt))
    result = WorkerRuntime(catalog, "cpu", probe_repeats=1).warm_template("support")
    assert result.status == "failed"
    assert result.error.startswith(f"model 'tiny' failed to load from {corrupt}: ")
