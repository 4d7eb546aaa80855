"""`preheat bench ttft` as a user runs it: a table, a JSON file, clear errors. Behaviour
only: the figures' size is the benchmark's business, not a test's."""

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tests.conftest import PREHEAT_CLI


def bench(stack, *args, timeout: float = 180):
    """`preheat bench ARGS…` through the installed command, in the stack's environment."""
    return subprocess.run(
        [PREHEAT_CLI, "bench", *args], env=stack.env, cwd=stack.home, capture_output=True, text=True, timeout=timeout
    )


def test_ttft_prints_the_table_and_writes_the_json(embedded_stack, tmp_path):
    out = tmp_path / "ttft.json"
    done = bench(embedded_stack, "ttft", "--lengths", "64,128", "--repeats", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "TTFT with and without the cached prefix" in done.stdout and "saved at 128 tokens" in done.stdout
    report = json.loads(out.read_text())
    assert [row["system_tokens"] for row in report["rows"]] == [64, 128]
    config = report["model"]
    for row in report["rows"]:
        assert row["same_first_token"] is True
        assert row["ttft_cold_ms"] > 0 and row["ttft_warm_ms"] > 0 and row["ttft_bare_ms"] > 0 and row["reuse_ms"] > 0
        # Exact bytes: layers x (keys + values) x kv heads x tokens x head dim x 4 bytes (float32),
        # and the logits after the prefix (vocabulary x 4 bytes).
        assert row["prefix_tokens"] > row["system_tokens"]  # the chat template's own tokens
        kv_bytes = config["layers"] * 2 * 2 * row["prefix_tokens"] * 64 * 4
        assert row["cache_bytes"] - kv_bytes == 4 * len(AutoTokenizer.from_pretrained(report["model"]["path"]))
        assert row["saved_pct"] == 100 * (1 - row["ttft_warm_ms"] / row["ttft_cold_ms"])
    assert set(report["targets"]) == {
        "saved_at_128_pct",
        "reuse_overhead_pct",
        "same_first_token",
        "restore_over_prefill_at_128",
    }
    assert all(row["restore_ms"] > 0 for row in report["rows"]) and "restore / prefill at 128" in done.stdout
    assert report["device"] == "cpu/float32" and report["repeats"] == 2
    turn_two = report["turn_two"]
    assert turn_two["cached_with_turn_one"] > turn_two["cached_prefix_only"] >= report["rows"][0]["prefix_tokens"]
    assert turn_two["same_first_token"] is True and "Turn two of a conversation" in done.stdout


def test_bad_input_is_one_line_and_a_non_zero_exit(embedded_stack):
    unknown = embedded_stack.cli_here("bench", "ttft", "--model", "nope")
    assert unknown.returncode == 2 and "unknown model 'nope'" in unknown.stderr
    too_long = embedded_stack.cli_here("bench", "ttft", "--lengths", "5000")
    assert too_long.returncode == 2 and "leaves no room in tiny's context of 4096" in too_long.stderr
    garbage = bench(embedded_stack, "ttft", "--lengths", "a,b")  # one through the installed command
    assert garbage.returncode == 2 and "not a comma-separated list" in garbage.stderr


def test_outbox_compares_direct_kept_and_replayed_writes_and_leaves_nothing_behind(stack, tmp_path):
    from sqlalchemy import func, select

    from preheat.history.db import session_scope
    from preheat.history.models import AppliedWrite, WarmupJob, WarmupRun

    out = tmp_path / "outbox.json"
    done = bench(stack, "outbox", "--writes", "20", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "20 kept, 20 replayed, 0 left in the outbox" in done.stdout
    report = json.loads(out.read_text())
    assert [way["name"] for way in report["ways"]] == [
        "written directly",
        "database away: kept in the outbox",
        "replayed once it is back",
    ]
    assert all(way["writes"] == 20 for way in report["ways"]) and report["left_in_outbox"] == 0
    with session_scope() as session:  # the throwaway run and its bookkeeping are gone
        for table in (WarmupRun, WarmupJob, AppliedWrite):
            assert session.scalar(select(func.count()).select_from(table)) == 0


@pytest.mark.slow
@pytest.mark.timeout(600)  # five launches, one compiling
def test_start_times_each_stage_against_the_limit_a_warm_store_prefills_and_a_warm_cache_compiles_nothing(
    embedded_stack, tmp_path
):
    out = tmp_path / "start.json"
    done = bench(
        embedded_stack, "start", "--shapes", "tiny", "--rounds", "1", "--settle", "0", "--json", str(out), timeout=400
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker start-up, stage by stage" in done.stdout and "tiny, warm store, eager: ready in" in done.stdout
    report = json.loads(out.read_text())
    limit = report["limits"]["tiny"]
    assert limit["total_s"] == pytest.approx(
        limit["interpreter_s"] + limit["imports_s"] + limit["read_s"] + limit["prefill_s"]
    )
    assert limit["weight_bytes"] > 10_000_000
    assert set(report["weight_loaders_s"]["tiny"]) == {"transformers", "safetensors", "runai-streamer"}  # side by side
    assert all(seconds > 0 for seconds in report["weight_loaders_s"]["tiny"].values())
    assert "tiny, weights to a resident model, page cache warm: transformers" in done.stdout
    rows = {(row["store"], row["steps"]): row for row in report["rows"]}
    empty, warm = rows["empty", "eager"], rows["warm", "eager"]
    assert (empty["prefills"], warm["prefills"], warm["restores"]) == (1, 0, 1)
    # Compiled: a cold compile stores the graphs, the next start restores them.
    cold, restored = rows["warm", "cold compile"], rows["warm", "warm compile cache"]
    assert (empty["compiled"], cold["compiled"], restored["compiled"]) == ("eager", "compiled", "restored")
    assert cold["compile_s"] > 0 and restored["compile_s"] > 0 and empty["compile_s"] == 0
    assert "tiny, warm store, cold compile: ready in" in done.stdout and "(reported beside)" in done.stdout
    for row in rows.values():
        # The stages come in order (ready: seen by the client, the others: the worker's log).
        assert 0 < row["first_log_s"] <= row["resident_s"] <= row["prefixes_s"]
        assert row["resident_s"] <= row["ready_s"] <= row["answered_s"]
        assert row["stop_s"] > 0 and row["ready_over_limit"] == pytest.approx(row["ready_s"] / limit["total_s"])


@pytest.mark.slow
def test_sleep_measures_both_levels_against_the_cold_start_from_the_records_and_the_process(embedded_stack, tmp_path):
    out = tmp_path / "sleep.json"
    done = bench(embedded_stack, "sleep", "--shape", "tiny", "--rounds", "1", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "asleep and woken against a cold start" in done.stdout and "level 1 gives back" in done.stdout
    report = json.loads(out.read_text())
    assert report["cold_start_s"] > 0 and report["steady_ttft_ms"] > 0
    assert [row["level"] for row in report["summary"]] == [1, 2]
    for row in report["rows"]:
        assert row["weight_bytes"] > 10_000_000 and row["kv_bytes"] > 0  # from the sleep job's record
        assert row["rss_before"] > row["rss_after"] > 0  # read from the worker's /proc
        assert row["wake_ms"] > 0 and row["wake_ready_s"] > 0 and row["first_request_ttft_ms"] > 0
        assert row["wake_status"] in ("warm", "degraded")
    for row in report["summary"]:
        assert row["wake_over_cold"] == pytest.approx(row["wake_ready_s"] / report["cold_start_s"])
    refused = embedded_stack.cli_here("bench", "sleep", "--shape", "7b")
    assert refused.returncode == 2 and "--shape must be one of real, 135m, tiny" in refused.stderr


def test_start_refuses_an_unknown_shape_and_a_negative_settle(embedded_stack):
    refused = embedded_stack.cli_here("bench", "start", "--shapes", "tiny,7b")
    assert refused.returncode == 2 and "--shapes: expected a comma-separated list of real, 135m, tiny" in refused.stderr
    refused = embedded_stack.cli_here("bench", "start", "--shapes", "tiny", "--settle", "-1")
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0 and "'--settle'" in refused.stderr
    assert not (embedded_stack.home / "bench" / "start.json").exists()  # nothing measured, nothing written


def test_a_bench_runs_the_engine_with_the_workers_openmp_settings_set_before_torch_loads(embedded_stack):
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: a bench that imported torch
    before preheat.workers set the workers' value measured another engine than a worker runs."""
    probe = (
        "import os, sys\n"
        "os.environ.pop('GOMP_SPINCOUNT', None)\n"
        "sys.argv = ['preheat', 'bench', 'limit', '--model', 'bogus']\n"
        "from preheat.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "loaded = list(sys.modules)\n"
        "print(loaded.index('preheat.workers') < loaded.index('torch'), os.environ['GOMP_SPINCOUNT'])\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=embedded_stack.env, capture_output=True, text=True)
    assert "--model must be one of" in done.stderr  # the bench's module was loaded, torch with it
    assert done.stdout.split() == ["True", "1000"], done.stdout + done.stderr


def test_limit_puts_each_step_beside_its_bound_a_long_context_reading_its_kv_too(embedded_stack, tmp_path):
    out = tmp_path / "limit.json"
    done = bench(embedded_stack, "limit", "--model", "tiny", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a decode step against the hardware" in done.stdout and "one row: preheat's step" in done.stdout
    report = json.loads(out.read_text())
    assert report["steps"] == "eager"  # PREHEAT_COMPILE=off, as every stack here
    assert report["step_gomp_spincount"] == "1000"  # the workers' (preheat/workers/__init__.py)
    rows = {(row["rows"], row["context"]): row for row in report["rows"]}
    assert list(rows) == [(1, 64), (16, 64), (1, 1024)]
    for row in rows.values():
        # The ratio of the unrounded times, to its third decimal: where a busy host's hardware
        # probe made the bound long, 0.037 was once written 0.04.
        assert row["preheat_step_ms"] > 0 and row["over_limit"] == pytest.approx(
            row["preheat_step_ms"] / row["limit_ms"], rel=0.02, abs=0.0005
        )
    # The long context's bound reads its KV beside the weights: higher than the short one's.
    assert rows[1, 1024]["bandwidth_limit_ms"] > rows[1, 64]["bandwidth_limit_ms"]


@pytest.mark.parametrize("bench_name", ["start", "load", "agreement"])
def test_an_unknown_compile_mode_is_refused_before_anything_runs(embedded_stack, bench_name):
    refused = embedded_stack.cli_here("bench", bench_name, "--compile", "max")
    assert refused.returncode == 2 and "--compile must be auto or off, got 'max'" in refused.stderr
    assert not (embedded_stack.home / "bench" / bench_name).exists()  # nothing measured, nothing written


@pytest.mark.slow
def test_load_runs_every_mode_on_the_same_users_and_reports_side_by_side(embedded_stack, tmp_path):
    """Batching, one at a time and through Celery, on the tiny model; transformers serve is
    asked for where this environment lacks its extras: one line says why it was not measured."""
    out = tmp_path / "load.json"
    done = bench(
        embedded_stack,
        # Eager steps: compiling is tested where it is the subject (tests/workers/engine).
        *("load", "--model", "tiny", "--compile", "off", "--users", "1,3", "--requests-per-user", "2"),
        *("--max-tokens", "4"),
        *("--arrivals", "3", "--rate", "20", "--modes", "batch,one-at-a-time,celery,transformers"),
        *("--transformers-python", str(tmp_path / "no-such-python"), "--json", str(out), "--restart"),
        timeout=400,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "many users at once, tiny dev model" in done.stdout
    report = json.loads(out.read_text())
    loads = [(row["mode"], row["load"]) for row in report["rows"]]
    assert loads == [
        ("batch", "closed 1 users"),
        ("batch", "closed 3 users"),
        ("batch", "poisson 20/s"),
        ("one-at-a-time", "closed 1 users"),
        ("one-at-a-time", "closed 3 users"),
        ("one-at-a-time", "poisson 20/s"),
        ("celery", "closed 1 users"),
        ("celery", "closed 3 users"),
    ]
    for row in report["rows"]:
        assert row["errors"] == 0 and row["tokens_per_s"] > 0 and row["ttft_p50_ms"] > 0
    assert {row["requests"] for row in report["rows"] if row["load"] == "closed 3 users"} == {9}  # 8 at least
    for row in report["rows"]:  # each load's TTFT p50 against its own server's single user
        expected = row["ttft_p50_ms"] / next(
            r["ttft_p50_ms"] for r in report["rows"] if r["mode"] == row["mode"] and r["load"] == "closed 1 users"
        )
        assert row["ttft_p50_over_single"] == pytest.approx(expected)
    assert "× 1 user" in done.stdout
    celery = [row for row in report["rows"] if row["mode"] == "celery"]
    assert all(row["client_p50_ms"] >= row["worker_p50_ms"] > 0 for row in celery)
    assert "no-such-python not found" in report["not_measured"]["transformers"]
    assert any(line.startswith("preheat.infer, closed 3 users: the caller waits") for line in report["verdicts"])
    # Restarted, preheat read its template's prefix back from its store before it was ready,
    # and says so twice: its store's count, and the first request's cached prompt tokens.
    [restarted] = report["restart"]
    assert (restarted["server"], restarted["restore"], restarted["error"]) == ("batch", "prefix store", None)
    assert restarted["restored"] >= 1 and restarted["ready_s"] > 0 and restarted["ttft_ms"] > 0
    assert 0 < restarted["cached_tokens"] < restarted["prompt_tokens"]


@pytest.mark.slow
def test_lora_puts_adapters_beside_the_base_and_a_warmed_adapter_beside_a_cold_one(embedded_stack, tmp_path):
    """On the tiny model, eager (the stack's PREHEAT_COMPILE=off: compiling is tested where it
    is the subject): every spread's 16 users answered, the three first requests timed."""
    out = tmp_path / "lora.json"
    args = ("lora", "--model", "tiny", "--rounds", "1", "--requests-per-user", "1", "--max-tokens", "2")
    done = bench(embedded_stack, *args, "--json", str(out), timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LoRA adapters · tiny, 16 users" in done.stdout
    report = json.loads(out.read_text())
    assert report["steps"] == "eager"
    # 17 adapters' templates and the base's, all pinned: at half the entries (the default share), 36
    assert report["prefix_cache_entries"] >= 36 and "prefix cache" in done.stdout
    many = report["many_users"]
    assert list(many) == ["base", "1 adapter(s)", "4 adapter(s)", "16 adapter(s)"]
    for row in many.values():
        assert (row["requests"], row["errors"]) == (16, 0) and row["tokens_per_s"] > 0, row
        assert len(row["rounds"]) == 1 and row["over_base"] > 0  # each spread over its own round's base
    assert many["base"]["over_base"] == 1.0
    first = report["first_request_ttft_ms"]
    assert list(first) == ["base", "warmed ahead", "cold"] and min(first.values()) > 0
    assert report["adapter_load_ms"] > 0
    assert [line.split(":")[0] for line in report["verdicts"]] == [
        "first request to an adapter warmed ahead",
        "16 users over 4 adapters",
    ]


def test_agreement_scores_each_dtype_against_float32_transformers_and_float32_is_exact(embedded_stack, tmp_path):
    out = tmp_path / "agreement.json"
    args = ("--model", "tiny", "--prompts", "3", "--max-tokens", "6", "--compile", "off", "--json", str(out))
    done = bench(embedded_stack, "agreement", *args, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "agreement with transformers float32" in done.stdout
    rows = {(r["server"], r["dtype"], r["batching"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {
        ("preheat", "bfloat16", "together"),
        ("preheat", "bfloat16", "alone"),
        ("transformers", "bfloat16", "alone"),
        ("preheat", "float32", "together"),
        ("preheat", "float32", "alone"),
    }
    for row in rows.values():
        assert row["prompts"] == 3 and 3 <= row["positions"] <= 18 and 0.0 <= row["top1_agreement"] <= 1.0
        assert row["max_logprob_gap"] >= row["mean_logprob_gap"] >= 0.0 and row["max_regret"] >= 0.0
    for batching in ("together", "alone"):  # the control: preheat's float32 is transformers' float32
        exact = rows["preheat", "float32", batching]
        assert exact["top1_agreement"] == 1.0 and exact["identical_answers"] == 3 and exact["max_logprob_gap"] < 1e-3
    assert rows["preheat", "float32", "together"]["same_as_alone"] == 3
    assert "float32 must be exact: met" in done.stdout


def test_agreement_refuses_an_unknown_dtype_before_anything_runs(embedded_stack):
    refused = embedded_stack.cli_here("bench", "agreement", "--dtypes", "float32,int8")
    assert (
        refused.returncode == 2 and "--dtypes: expected a comma-separated list of float32, bfloat16" in refused.stderr
    )
    assert not (embedded_stack.home / "bench" / "agreement").exists()


def test_load_refuses_an_unknown_mode(embedded_stack):
    refused = embedded_stack.cli_here("bench", "load", "--modes", "batch,vllm")
    assert refused.returncode == 2 and "--modes: expected a comma-separated list of batch" in refused.stderr
    refused = embedded_stack.cli_here("bench", "load", "--modes", "one-at-a-time", "--restart")
    assert refused.returncode == 2 and "--restart: measured for batch and llama-server" in refused.stderr


def test_history_measures_each_command_before_and_after_the_indexes_on_a_scratch_database(
    services_stack, tmp_path, pg_admin
):
    out = tmp_path / "history.json"
    done = bench(services_stack, "history", "--jobs", "4000", "--days", "100", "--repeats", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert (report["runs"], report["jobs"]) == (1000, 4000)
    queries = {row["name"]: row for row in report["queries"]}
    assert {"preheat history", "preheat history --status running", "preheat workers"} <= set(queries)
    for row in queries.values():
        assert set(row["ms"]) == {"without", "with"} and all(ms > 0 for ms in row["ms"].values())
        assert row["plans"]["with"], row  # each statement it sent, with PostgreSQL's plan
    assert any(
        "ix_warmup_jobs_celery_task_id" in plan for plan in queries["a task's failure (worker)"]["plans"]["with"]
    )
    assert not any("celery_task_id" in plan for plan in queries["a task's failure (worker)"]["plans"]["without"])
    pruned = report["prune"]
    assert pruned["counted"] == pruned["deleted"] and pruned["deleted"]["warmup_jobs"] > 0
    scratch = pg_admin.execute("SELECT datname FROM pg_database WHERE datname LIKE 'preheat_bench_history_%'")
    assert scratch.fetchall() == []  # dropped at the end


def test_history_refuses_sqlite_with_the_reason(embedded_stack):
    done = embedded_stack.cli_here("bench", "history", "--jobs", "1000")
    assert done.returncode == 2 and "measures PostgreSQL" in done.stderr


def test_memory_compares_the_layouts_in_fresh_processes_and_the_slab_returns_on_eviction(embedded_stack, tmp_path):
    out = tmp_path / "memory.json"
    done = bench(embedded_stack, "memory", "--shape", "tiny", "--templates", "3", "--tokens", "256", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "resident memory per cached template" in done.stdout and "slab (production)" in done.stdout
    rows = {row["layout"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["heap", "heap + trim", "slab"]
    assert len({row["kv_bytes"] for row in rows.values()}) == 1  # the same pre-fills, counted alike
    # Evicted, a slab is unmapped at once: its pages come back whole. (What the heap layouts
    # give back is the allocator's choice, and a few MiB of a tiny model's entries are within
    # what else the process frees meanwhile: reported, not compared.)
    slab = rows["slab"]
    assert slab["returned_on_eviction"] >= 0.9 * slab["kv_bytes"], slab
