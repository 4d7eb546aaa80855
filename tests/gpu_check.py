"""The CUDA path, checked on a GPU host (CI has none): `python3 -m tests.gpu_check OUT.json`.

Not a pytest module (it needs a GPU and runs in one process, in about a minute). It builds the
small model, lets the registry pick the device (CUDA, bf16), and checks what the CPU tests
cannot: the cached prefix on CUDA in bf16 gives full prefill's greedy token; the steps compiled
on CUDA and loaded again by a new runtime, against eager; the decode steps captured as CUDA
graphs, replayed, token for token against eager in float32; and a real CUDA
out-of-memory during a prefill (the caching allocator capped with
set_per_process_memory_fraction) is one DeviceOutOfMemory naming the work, with the memory
given back, after which the same prefill succeeds; and how fast weights load onto the GPU
against the host-to-device bandwidth.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from preheat.cli.devmodel import make_model
from preheat.core.errors import DeviceOutOfMemory
from preheat.workers.engine.chat import TemplatePrefix, conversation, render
from preheat.workers.engine.device import pick_placement
from preheat.workers.engine.kvcache import CacheBudget, KVCacheManager
from preheat.workers.engine.prefixes import Prefixes
from preheat.workers.engine.resident import ModelSource, ResidentModels
from preheat.workers.engine.scheduler import Scheduler
from preheat.workers.engine.weights import streamer_installed
from preheat.workers.warmup import probe

SYSTEM = (
    "You are the support assistant of Acme Parcel. Be concise and polite. Always ask for the tracking number "
    "first. Never promise a delivery date the tracking system does not show."
)
LONG = " ".join(f"Rule {n}: a parcel late by {n % 7 + 2} working days is investigated." for n in range(150))


def check(out: Path) -> dict:
    report: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check is for a GPU host")
    report["gpu"] = torch.cuda.get_device_name(0)
    folder = make_model(Path(tempfile.mkdtemp()) / "tiny")
    registry = ResidentModels("auto")
    resident, _ = registry.ensure(ModelSource("tiny", str(folder)))
    report["placement"] = resident.placement.describe()
    scheduler = Scheduler(Prefixes(KVCacheManager(CacheBudget(16, 2**30))))

    prefix = TemplatePrefix.of(resident, SYSTEM)
    prefilled = scheduler.prefill(resident, prefix.ids, label="support", pin=True)
    entry, prefill_ms = prefilled.entry, prefilled.prefill_ms
    measured = probe(
        scheduler,
        resident,
        prefix.prompt_ids(resident, "Where is my parcel?"),
        render(resident, conversation(None, "Where is my parcel?")),
        5,
    )
    report["prefix"] = {
        "tokens": entry.num_tokens,
        "bytes": entry.nbytes,
        "prefill_ms": prefill_ms,
        "ttft_cold_ms": measured.cold.ms,
        "ttft_warm_ms": measured.warm.ms,
        "ttft_bare_ms": measured.bare.ms,
        "cached_tokens": measured.warm.cached_tokens,
        "same_first_token": measured.cold.token_id == measured.warm.token_id,
    }

    long_ids = TemplatePrefix.of(resident, LONG).ids
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    # Cap the caching allocator just above what it holds now: the long prefill cannot fit.
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 2**20) / total)
    started, message = time.perf_counter(), None
    try:
        scheduler.prefill(resident, long_ids, label="handbook")
    except DeviceOutOfMemory as exc:
        message = str(exc)
    # Measured once the error is gone, as a worker's next step would see it.
    report["oom"] = {
        "raised": message is not None,
        "message": message,
        "ms": (time.perf_counter() - started) * 1000,
        "allocated_after_minus_before": torch.cuda.memory_allocated() - baseline,
        "cache_entries_after": scheduler.prefixes.cache.stats().entries,
    }
    torch.cuda.set_per_process_memory_fraction(1.0)
    again = scheduler.prefill(resident, long_ids, label="handbook")
    again, again_ms = again.entry, again.prefill_ms
    report["after_oom"] = {"prefilled_tokens": again.num_tokens, "prefill_ms": again_ms}
    scheduler.close()
    report["compiled_steps"] = compiled_steps(folder)
    report["decode_graphs"] = decode_graphs(folder)
    report["load"] = load_bandwidth()
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def compiled_steps(folder: Path) -> dict:
    """The steps compiled on CUDA (Triton, bf16), then loaded as a restarted worker loads
    them (a new runtime of the same model): how each start went and how long it took, and
    the same greedy request eager, compiled and loaded. bf16 rounds differently compiled, so
    the tokens are reported side by side, not asserted equal."""
    from preheat.api.sampling import SamplingParams
    from preheat.workers.engine.compilestore import CompileStore

    store, report, tokens = CompileStore(Path(tempfile.mkdtemp())), {}, {}
    for run in ("eager", "compiled", "loaded"):
        resident, _ = ResidentModels("auto").ensure(ModelSource("tiny", str(folder)))
        scheduler = Scheduler(Prefixes(KVCacheManager(CacheBudget(16, 2**30))))
        if run != "eager":
            done = scheduler.compile(resident.runner, "auto", store, resident.content_digest)
            graphs = resident.runner.decode_graphs
            report[run] = {"source": done.source, "ms": done.ms, "reason": done.reason}
            report[run]["decode_graph_sizes"] = graphs.sizes if graphs is not None else None
        prompt = TemplatePrefix.of(resident, SYSTEM).prompt_ids(resident, "Where is my parcel?")
        started = time.perf_counter()
        answer = scheduler.submit(resident, prompt, SamplingParams(max_tokens=24, temperature=0.0)).collect()
        report[f"{run}_answer_ms"] = (time.perf_counter() - started) * 1000
        tokens[run] = answer.token_ids
        scheduler.call(resident.runner.release)  # as a worker's stop: the next runtime is a restart
        scheduler.close()
    report["tokens"] = tokens
    report["compiled_as_eager"] = tokens["compiled"] == tokens["eager"]
    report["loaded_as_compiled"] = tokens["loaded"] == tokens["compiled"]
    return report


def decode_graphs(folder: Path) -> dict:
    """The decode steps as CUDA graphs, in float32 so that tokens compare exactly: four
    requests together (padded to a captured size) and each alone, run eager and then replayed
    from the graphs a compile captured (its proof of each graph passed, or it would have
    none); the sizes captured, how long that took, and how many steps each size replayed."""
    import threading

    from preheat.api.sampling import SamplingParams
    from preheat.workers.engine.batch import BatchLimits

    questions = ("Where is my parcel?", "Can I change the address?", "Hello", "My parcel is damaged.")
    report: dict = {}
    tokens: dict = {}
    for run in ("eager", "graphs"):
        resident, _ = ResidentModels("cuda", dtype_preference="float32").ensure(ModelSource("tiny", str(folder)))
        scheduler = Scheduler(Prefixes(KVCacheManager(CacheBudget(16, 2**30))), BatchLimits(max_running=8))
        graphs = None
        if run == "graphs":
            done = scheduler.compile(resident.runner, "auto", None, resident.content_digest)
            graphs = resident.runner.decode_graphs
            report["compile"] = {"source": done.source, "ms": done.ms, "reason": done.reason}
            report["sizes"] = graphs.sizes if graphs is not None else None
        prefix = TemplatePrefix.of(resident, SYSTEM)
        prompts = [prefix.prompt_ids(resident, text) for text in questions]
        together: list = [None] * len(prompts)

        def one(i: int, scheduler=scheduler, resident=resident, prompts=prompts, together=together) -> None:
            greedy = SamplingParams(max_tokens=24, temperature=0.0)
            together[i] = scheduler.submit(resident, prompts[i], greedy).collect().token_ids

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        alone = [
            scheduler.submit(resident, ids, SamplingParams(max_tokens=24, temperature=0.0)).collect().token_ids
            for ids in prompts
        ]
        tokens[run] = {"together": together, "alone": alone}
        if graphs is not None:
            report["steps_replayed"] = {str(size): n for size, n in graphs.steps_run.items()}
        scheduler.call(resident.runner.release)
        scheduler.close()
    report["tokens"] = tokens
    report["graphs_as_eager"] = tokens["graphs"] == tokens["eager"]
    report["replayed"] = sum(report.get("steps_replayed", {}).values()) > 0
    return report


def load_bandwidth() -> dict:
    """Weights loaded onto the GPU (the registry's path, straight to the device) in GB/s, by
    transformers and, where installed, by the Run:ai Model Streamer (`auto` takes it on CUDA),
    against the host-to-device copy bandwidth of pinned memory: how far loading is from
    the bus. A 135 M-shaped model, so the figure is not all fixed costs."""
    from preheat.cli.devmodel import ModelShape

    folder = make_model(
        Path(tempfile.mkdtemp()) / "m135", shape=ModelShape(576, 1536, 30, 9, 3, 2048, padded_vocab=49152)
    )
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    for path in folder.glob("*.safetensors"):
        path.read_bytes()  # in the page cache, as on a node that ran the model before
    loads = {}
    for loader in ("transformers", "safetensors") + (("runai-streamer",) if streamer_installed() else ()):
        started = time.perf_counter()
        resident, _ = ResidentModels("auto", loader).ensure(ModelSource(f"m135-{loader}", str(folder)))
        torch.cuda.synchronize()
        loads[loader] = time.perf_counter() - started
        del resident
        torch.cuda.empty_cache()
    load_s = loads["transformers"]
    host = torch.empty(size // 4, dtype=torch.float32).pin_memory()
    device = torch.empty_like(host, device="cuda")
    device.copy_(host, non_blocking=True)  # a first copy pays one-off costs
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(5):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d_gbps = 5 * size / (time.perf_counter() - started) / 1e9
    return {
        "weight_bytes": size,
        "placement": pick_placement("auto").describe(),
        "load_s": load_s,
        "load_s_by_loader": loads,
        "load_gbps_by_loader": {loader: size / seconds / 1e9 for loader, seconds in loads.items()},
        "load_gbps": size / load_s / 1e9,
        "host_to_device_gbps": h2d_gbps,
        "load_over_bus": (size / load_s / 1e9) / h2d_gbps,
    }


if __name__ == "__main__":
    print(json.dumps(check(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_check.json")), indent=2))
