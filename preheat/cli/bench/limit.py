"""`preheat bench limit`: what the hardware allows a decode step, measured, beside preheat's.

- **Bandwidth limit (one row).** A decode step at one row reads every weight once: the
  weight bytes over the memory bandwidth measured here (a sum over a buffer four times the
  size of the last-level cache, best of several) is the step no engine can beat.
- **Compute limit (16 rows).** At 16 rows the step's matrix products are 2 × parameters ×
  16 FLOPs: over the matmul throughput measured here at the step's own shapes (16 rows
  through the model's largest linear, in its dtype), the step no engine can beat.
- **A long context (one row).** The same step after 1,024 ids: it reads the row's keys and
  values too, so its limit is the weights and that KV over the bandwidth.
- **preheat's step.** The production runner (`ModelRunner.step`, compiled as the worker
  would: PREHEAT_COMPILE, PREHEAT_DTYPE, and the workers' OpenMP spin), on rows that each
  pre-filled their context, then decode steps timed one by one (median of 32).

The limits are measured in a process of their own, its OpenMP threads spinning as long as
libgomp's default (a worker's short spin, GOMP_SPINCOUNT, is set before torch loads and cannot
change after): a tiny product called again and again then never waits for a sleeping thread,
which is the hardware's number, not a setting's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.table import Table

from preheat.cli.bench.common import dev_model, host, write_report

STEPS = ((1, 64), (16, 64), (1, 1024))  # (rows, ids each pre-filled)
STEPS_TIMED = 32
CHUNK = 128  # a long context is pre-filled in chunks, as the scheduler feeds a prompt


def _best_ms(work, repeats: int) -> float:
    work()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, (time.perf_counter() - started) * 1000)
    return best


def bandwidth_gbs() -> float:
    """Bytes a core set can read per second: a sum over a 1 GiB float32 buffer, best of 5."""
    buffer = torch.ones(256 * 1024**2, dtype=torch.float32)
    ms = _best_ms(lambda: buffer.sum(), 5)
    return buffer.nbytes / (ms / 1000) / 1e9


def matmul_flops(rows: int, inner: int, outer: int, dtype: torch.dtype) -> float:
    """FLOP/s of `rows` × `inner` @ `inner` × `outer` in `dtype`, best of 20."""
    x, w = torch.randn(rows, inner, dtype=dtype), torch.randn(outer, inner, dtype=dtype)
    ms = _best_ms(lambda: torch.nn.functional.linear(x, w), 20)
    return 2 * rows * inner * outer / (ms / 1000)


# In a process of its own (`hardware`): the memory bandwidth and each row count's matmul
# throughput at the model's shapes, in its dtype.
HARDWARE_SCRIPT = r"""
import json, sys
import torch
from preheat.cli.bench.limit import bandwidth_gbs, matmul_flops
hidden, intermediate, dtype, rows = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4:]
print(json.dumps({"bandwidth_gbs": bandwidth_gbs(),
                  "flops": {n: matmul_flops(int(n), hidden, intermediate, dtype) for n in rows}}))
"""


def hardware(hidden: int, intermediate: int, dtype: torch.dtype, rows: list[int]) -> tuple[float, dict[int, float]]:
    """(memory bandwidth GB/s, matmul FLOP/s per row count), measured in a fresh process with
    libgomp's default spin (see the module's docstring)."""
    env = {name: value for name, value in os.environ.items() if name != "GOMP_SPINCOUNT"}
    argv = [sys.executable, "-c", HARDWARE_SCRIPT, str(hidden), str(intermediate), str(dtype).removeprefix("torch.")]
    done = subprocess.run([*argv, *map(str, rows)], capture_output=True, text=True, env=env, check=True)
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return measured["bandwidth_gbs"], {int(n): flops for n, flops in measured["flops"].items()}


def step_ms(runner, rows: int, context: int = 64) -> float:
    """Median ms of a decode step of `rows` rows, each after a pre-fill of `context` ids."""
    from preheat.workers.engine.raggedkv import Segment

    kv = runner.new_batch()
    for _ in range(rows):
        kv.add(None, context + STEPS_TIMED + 8)
    for start in range(0, context, CHUNK):
        ids = tuple(range(start + 1, min(context, start + CHUNK) + 1))
        runner.step(kv, [Segment(slot, kv.lengths[slot], ids) for slot in range(rows)])
        kv.stepped()
    times = []
    for step in range(STEPS_TIMED + 2):
        segments = [Segment(slot, kv.lengths[slot], (7 + step,)) for slot in range(rows)]
        started = time.perf_counter()
        runner.step(kv, segments)
        if step >= 2:  # the first two settle the buffers
            times.append((time.perf_counter() - started) * 1000)
        kv.stepped()
    return statistics.median(times)


def main(*, shape: str, json_path: Path | None) -> None:
    from preheat.cli import render
    from preheat.core.settings import get_settings
    from preheat.workers.engine.compilestore import CompileStore
    from preheat.workers.engine.device import fast_dtype
    from preheat.workers.engine.resident import ModelSource, ResidentModels
    from preheat.workers.sleep import weight_bytes

    console = render.console()
    settings = get_settings()
    folder = settings.home / "bench" / "limit"
    model_dir = dev_model(folder / "models" / shape, shape, console)
    fast = str(fast_dtype(torch.device("cpu"))).removeprefix("torch.")
    dtype = fast if settings.dtype == "auto" else settings.dtype
    resident, _ = ResidentModels("cpu", dtype_preference=dtype).ensure(ModelSource(shape, str(model_dir)))
    report = resident.runner.compile(settings.compile, CompileStore(folder / "compiled"), resident.content_digest)
    while (work := resident.runner.idle_work()) is not None:  # a worker's steady state: packed while idle
        work()
    console.print(f"{shape} in {dtype}; steps {report.source}{f' ({report.reason})' if report.reason else ''}")
    weights = weight_bytes(resident.model)
    parameters = sum(p.numel() for p in resident.model.parameters())
    config = resident.model.config.get_text_config()
    torch_dtype = next(resident.model.parameters()).dtype
    bandwidth, throughput = hardware(
        config.hidden_size, config.intermediate_size, torch_dtype, sorted({rows for rows, _ in STEPS})
    )
    rows_out = []
    for rows, context in STEPS:
        flops = throughput[rows]
        # Every weight once, and each row's keys and values of its context.
        read = weights + rows * context * resident.kv_bytes_per_token
        bound_bandwidth = read / (bandwidth * 1e9) * 1000
        bound_compute = 2 * parameters * rows / flops * 1000
        measured = step_ms(resident.runner, rows, context)
        # One row reads every weight once: held to the bandwidth. Many rows: to the slower bound.
        limit = bound_bandwidth if rows == 1 else max(bound_bandwidth, bound_compute)
        rows_out.append(
            {
                "rows": rows,
                "context": context,
                "bandwidth_limit_ms": round(bound_bandwidth, 2),
                "compute_limit_ms": round(bound_compute, 2),
                "limit_ms": round(limit, 2),
                "preheat_step_ms": round(measured, 2),
                "over_limit": round(measured / limit, 3),  # 2 decimals lost a tenth of 0.037
                "matmul_gflops": round(flops / 1e9, 1),
            }
        )
    result = {
        "host": host(),
        "model": shape,
        "dtype": dtype,
        "steps": report.source,
        "weight_bytes": weights,
        "parameters": parameters,
        "bandwidth_gbs": round(bandwidth, 1),
        # The step's OpenMP spin (the workers'); the limits ran with libgomp's default.
        "step_gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "libgomp's default"),
        "rows": rows_out,
        "verdicts": [
            f"one row: preheat's step {rows_out[0]['preheat_step_ms']} ms = {rows_out[0]['over_limit']}× the "
            f"bandwidth limit (target ≤ 1.5×: {'met' if rows_out[0]['over_limit'] <= 1.5 else 'NOT met'})"
        ],
    }
    table = Table(title=f"a decode step against the hardware · {shape}, {dtype}, {weights / 2**20:,.0f} MiB of weights")
    for header in (
        "rows",
        "context",
        "bandwidth limit ms",
        "compute limit ms",
        "preheat step ms",
        "× the limit",
        "matmul GFLOP/s",
    ):
        table.add_column(header, justify="right")
    for row in rows_out:
        table.add_row(
            str(row["rows"]),
            f"{row['context']:,}",
            f"{row['bandwidth_limit_ms']:.2f}",
            f"{row['compute_limit_ms']:.2f}",
            f"{row['preheat_step_ms']:.2f}",
            f"{row['over_limit']:.2f}",
            f"{row['matmul_gflops']:,.1f}",
        )
    console.print(table)
    console.print(
        f"memory bandwidth {bandwidth:.1f} GB/s; limits measured with libgomp's default spin, preheat's step with "
        f"GOMP_SPINCOUNT={result['step_gomp_spincount']} (a worker's); " + "; ".join(result["verdicts"])
    )
    write_report(result, json_path or folder / "limit.json", console)
