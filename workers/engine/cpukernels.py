"""preheat's own CPU kernels, where the CPU has AVX512-BF16: one row's linear layers and one
query's attention in bfloat16, with the CPU's bf16 dot product (`vdpbf16ps`: exact products,
float32 sums; llama.cpp's BF16 dot product uses it too), and the LoRA adapters of a step.

**One row's linear layers** (`matvec`, the op `preheat::matvec_bf16` a compiled one-token
graph calls: preheat.workers.engine.compiled). A single user's step reads every weight once
for one row, so its speed is the speed at which the layers stream their weights. The loops
inductor writes for them in bf16 (a float32 multiply-add per weight, after widening it)
stream at half the memory's speed (2 cores of a Sapphire Rapids: 15.5 GB/s against 28.3 for
a float32 sum); this kernel streams each thread's rows in order. The real model's one-row
step went from 22.3 to 15.2 ms on that host.

**One query's attention** (`attend_rows`, what preheat.workers.engine.raggedkv runs for a
lone decoding row, and for a batch's decoding rows on a layer without a window). torch's
SDPA for one bf16 query costs 44 µs a layer at 64 keys and 597 µs at 1,024 on a Zen 4
without AMX (2 cores), where its float32 path takes 15 and 79 µs and the casts to it cost
more than they save; a batch's rows went through a batched product with a mask, 716 µs a
layer at 16 rows. This kernel reads each row's keys and values once, in bf16, with a
float32 softmax, all rows and heads in one call.

**The step's LoRA adapters** (`lora_add`, the op `preheat::lora_add` the compiled steps call
on every adapted linear layer: preheat.workers.engine.compiled). Each token goes through its
own adapter's columns of the stacks (preheat.workers.engine.lorastack) and no other's, as
Punica's and S-LoRA's grouped kernels do on GPUs: the masked products it replaces computed
every adapter's for every token, and cost small BLAS calls of a few hundred µs each on 2
cores (16 rows over 4 adapters: 297 ms a step against 107 on the base). bf16 or float32.

The kernels are C with CPython entry points, built by the machine's C compiler (1.4 s on 2
cores, in a worker's start) and kept in `~/.cache/preheat/kernels` under a key of their
source, compiler, flags and Python ABI, with the digest of the built file: the next process
loads them only once the file's bytes prove whole against it, and builds them again where
they do not (or where the folder cannot be written). They run on torch's OpenMP threads (the
process's libgomp, which inductor's kernels use too). Where they cannot be built, torch
computes the same thing, slower, and preheat says why once.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from preheat.workers.engine.device import cpu_flags

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kit:
    """One module of kernels: its C sources, what its instructions need of the CPU, the flags
    that let the compiler emit them."""

    module: str  # the module's name (its PyInit_<module>)
    sources: tuple[Path, ...]
    needs: tuple[str, ...]
    isa: tuple[str, ...]


_HERE = Path(__file__).parent
# The bfloat16 kernels (AVX512-BF16 and the AVX-512 it extends; AMX where granted), and the
# float32 small step (smallstep_f32.c) for a CPU without fast bfloat16: AVX2 and FMA.
BF16 = Kit(
    "preheat_cpukernels",
    tuple(_HERE / name for name in ("cpukernels.c", "smallstep.c", "amx.c")),
    ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
)
F32 = Kit("preheat_cpukernels_f32", (_HERE / "smallstep_f32.c",), ("avx2", "fma"), ("-mavx2", "-mfma"))
HEADERS = (_HERE / "cpukernels.h", _HERE / "smallstep.h")  # what the sources include: in every kit's key
KEPT = Path.home() / ".cache" / "preheat" / "kernels"  # built kernels, each beside its digest

_BUILD_LOCK = threading.Lock()
_BUILT: dict[Kit, tuple[object | None, str | None]] = {}


def why_not_built(kit: Kit = BF16) -> str | None:
    """Why this machine cannot run `kit`'s kernels, or None when it can (they are then built)."""
    return _built(kit)[1]


def available(kit: Kit = BF16) -> bool:
    return _built(kit)[0] is not None


def _built(kit: Kit = BF16) -> tuple[object | None, str | None]:
    """(the kit's module, None) or (None, why not): built once a process, by the first call (two
    threads' first calls build it once; later calls, a step's, take no lock)."""
    if (built := _BUILT.get(kit)) is None:
        with _BUILD_LOCK:
            if (built := _BUILT.get(kit)) is None:
                built = _BUILT[kit] = _build(kit)
    return built


def _build(kit: Kit = BF16) -> tuple[object | None, str | None]:
    if missing := [flag for flag in kit.needs if flag not in cpu_flags()]:
        return None, f"the CPU lacks {', '.join(missing)}"
    compiler = next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)
    if compiler is None:
        return None, "no C compiler on this machine"
    headers = Path(sysconfig.get_paths()["include"])
    if not (headers / "Python.h").is_file():
        return None, f"no Python headers in {headers} (apt-get install python3-dev)"
    flags = ["-O3", *kit.isa, "-fopenmp", "-shared", "-fPIC", f"-I{headers}"]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    texts = [path.read_text() for path in (*kit.sources, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, compiler, version, *flags, suffix]).encode()).hexdigest()[:32]
    built = _kept(key, suffix)
    if built is None:
        folder = Path(tempfile.mkdtemp(prefix="preheat-cpukernels-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        built = folder / f"{kit.module}{suffix}"
        argv = [compiler, *flags, *map(str, kit.sources), "-o", built.name]
        done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            return None, f"the kernels did not build ({compiler}: {first})"
        _keep(built, key, suffix)
    # torch is loaded, so the module's libgomp is torch's: one OpenMP runtime in the process.
    spec = importlib.util.spec_from_file_location(kit.module, built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if kit is BF16:
        log.info("bf16 kernels: one-row products fetch %d rows ahead on this CPU", module.ahead_rows())
    return module, None


def _kept(key: str, suffix: str) -> Path | None:
    """The kept build of `key`, once its bytes match the digest kept beside it; else None."""
    built, digest = KEPT / f"{key}{suffix}", KEPT / f"{key}.sha256"
    try:
        expected, data = digest.read_text().strip(), built.read_bytes()
    except OSError:
        return None  # never built here, or not readable: built again
    if hashlib.sha256(data).hexdigest() != expected:
        log.warning("the kept kernels %s do not match their digest: built again", built)
        return None
    return built


def _keep(built: Path, key: str, suffix: str) -> None:
    """The build kept for the next process: the file, then its digest, each written whole
    (a rename), so a reader never meets half of either; a folder that cannot be written
    costs the next process a build."""
    try:
        KEPT.mkdir(parents=True, exist_ok=True)
        data = built.read_bytes()
        for name, content in ((f"{key}{suffix}", data), (f"{key}.sha256", hashlib.sha256(data).hexdigest().encode())):
            partial = KEPT / f".{name}.{os.getpid()}.partial"
            partial.write_bytes(content)
            os.replace(partial, KEPT / name)
    except OSError as exc:
        log.info("the kernels are not kept in %s (%s): the next process builds them", KEPT, exc)


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`weight @ x` for one row `x` ([..., 1, K], bfloat16) and `weight` ([N, K], bfloat16),
    in float32: [..., 1, N]."""
    one_row = x.numel() == x.shape[-1] and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
    if not one_row or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(
            f"matvec_bf16 takes one bf16 row and bf16 weights of its length, "
            f"got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}"
        )
    # torch.empty's sizes as arguments, not a tuple: 1 us less a call (211 calls a step).
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
    kernels = _built()[0]
    if kernels is None:
        _fallback_once(why_not_built())
        return torch.mv(weight.float(), x.reshape(-1).float()).view(out.shape)
    x, weight = x.contiguous(), weight.contiguous()
    kernels.matvec_bf16(weight.data_ptr(), x.data_ptr(), out.data_ptr(), weight.shape[0], weight.shape[1])
    return out


def attends(query: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `attend_rows` computes a layer's attention for these queries and keys: bfloat16
    on the CPU, a head size a multiple of 32 and at most 256, whole groups of heads, and the
    kernels built here. A caller asks before making the rows' table."""
    if query.dtype is not torch.bfloat16 or keys.dtype is not torch.bfloat16 or not query.is_cpu:
        return False
    head_dim = query.shape[-1]
    if head_dim % 32 or head_dim > 256 or query.shape[1] % keys.shape[1]:
        return False
    if not available():
        _fallback_once(why_not_built())
        return False
    return True


def attend_rows(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    most_columns: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Rows that each feed one query against their own slot, every column they hold seen
    (preheat.workers.engine.raggedkv): `query` [1, heads, tokens, head_dim] and a layer's
    `keys` and `values` [slots, kv_heads, capacity, head_dim], bfloat16 on the CPU; `rows`
    [n, 3] int64 (packed token, slot, columns), `most_columns` their largest. Written into
    `out` [1, tokens, heads, head_dim] (other tokens untouched; a new one when None) and
    returned. None where this kernel does not compute it (another dtype or device, a head size
    not a multiple of 32 or over 256): the caller's torch path does."""
    if not attends(query, keys):
        return None
    kernels = _built()[0]
    _, heads, tokens, head_dim = query.shape
    slots, kv_heads, capacity = keys.shape[:3]
    if out is None:
        out = torch.empty(1, tokens, heads, head_dim, dtype=torch.bfloat16)
    # The kernel trusts these with raw addresses: checked by value (the rows' own, in C).
    if (
        query.shape[0] != 1
        or keys.shape != values.shape
        or keys.shape[-1] != head_dim
        or values.dtype != keys.dtype
        or out.shape != (1, tokens, heads, head_dim)
        or out.dtype != torch.bfloat16
        or not out.is_contiguous()
        or rows.dtype != torch.int64
        or rows.dim() != 2
        or rows.shape[1] != 3
    ):
        raise ValueError(
            f"attend_rows takes queries, a layer's keys and values of their head size, [n, 3] int64 rows and "
            f"its output, got {tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}, "
            f"{tuple(rows.shape)} {rows.dtype} and {tuple(out.shape)} {out.dtype}"
        )
    query, keys, values, rows = query.contiguous(), keys.contiguous(), values.contiguous(), rows.contiguous()
    scores = torch.empty(rows.shape[0] * heads * most_columns, dtype=torch.float32)
    kernels.attention_bf16(
        query.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        out.data_ptr(),
        scores.data_ptr(),
        rows.data_ptr(),
        rows.shape[0],
        tokens,
        heads,
        kv_heads,
        head_dim,
        capacity,
        most_columns,
        slots,
        float(scale),
    )
    return out


def lora_add(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    columns: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`y` plus each token's own adapter's delta: x [..., in] and y [..., out] (one linear
    layer's input and output, bf16 or float32), a [width, in] and b [width, out] a layer's
    stacks (bf16 or float32, the scaling in b), columns [tokens, 2] int64 each token's (first column,
    rank), rank 0 for the base's tokens. Into `out` where given (y itself, contiguous: the op
    `preheat::packed_linear_lora`), else a new tensor of y's shape and dtype."""
    # One call per adapted linear layer of a step (210 on the real model): each check a
    # fraction of a µs, the output `empty_like` (torch.empty of a shape costs 3 µs).
    width, in_len = a.shape
    tokens, pair = columns.shape
    out_len = b.shape[-1]
    if (
        x.dtype is not y.dtype
        or x.dtype not in (torch.bfloat16, torch.float32)
        or a.dtype not in (torch.bfloat16, torch.float32)
        or b.dtype is not a.dtype
        or columns.dtype is not torch.int64
        or pair != 2
        or x.shape[-1] != in_len
        or b.shape[0] != width
        or y.shape[-1] != out_len
        or x.numel() != tokens * in_len
        or y.numel() != tokens * out_len
        or (out is not None and (out.dtype is not y.dtype or out.shape != y.shape or not out.is_contiguous()))
    ):
        raise ValueError(
            f"lora_add takes a layer's input and output, its [width, in] and [width, out] stacks of one dtype, "
            f"[tokens, 2] int64 columns and an output like y's (contiguous), got {tuple(x.shape)} {x.dtype}, "
            f"{tuple(y.shape)} {y.dtype}, {tuple(a.shape)} {a.dtype}, {tuple(b.shape)} {b.dtype}, "
            f"{tuple(columns.shape)} {columns.dtype}"
            + ("" if out is None else f" and {tuple(out.shape)} {out.dtype}{'' if out.is_contiguous() else ' strided'}")
        )
    kernels = _built()[0]
    if kernels is None:
        _fallback_once(why_not_built(), "LoRA adapters' products")
        where = torch.arange(width, device=a.device)
        first, rank = columns[:, :1], columns[:, 1:]
        mask = ((where >= first) & (where < first + rank)).float()
        delta = (x.reshape(tokens, in_len).float() @ a.float().t()) * mask @ b.float()
        added = (y.reshape(tokens, out_len).float() + delta).to(y.dtype).view(y.shape)
        return added if out is None else out.copy_(added)
    x, y, a, b, columns = x.contiguous(), y.contiguous(), a.contiguous(), b.contiguous(), columns.contiguous()
    out = torch.empty_like(y) if out is None else out
    kernels.lora_add(
        x.data_ptr(), y.data_ptr(), out.data_ptr(), a.data_ptr(), b.data_ptr(), columns.data_ptr(),
        tokens, in_len, out_len, width, x.dtype is torch.bfloat16, a.dtype is torch.bfloat16
    )  # fmt: skip
    return out


def small_step_kit(dtype: torch.dtype) -> Kit | None:
    """The kit whose small step computes a model of `dtype`: `smallstep.c` for bfloat16,
    `smallstep_f32.c` for float32; None for another dtype."""
    return {torch.bfloat16: BF16, torch.float32: F32}.get(dtype)


def small_step(kit: Kit, *args) -> None:
    """A Llama-family decoder's small step (`kit`'s): what preheat.workers.engine.smallstep
    passes, its addresses proven there, its sizes, ids and places in C."""
    kernels = _built(kit)[0]
    if kernels is None:
        raise RuntimeError(f"the small step's kernel does not run here: {why_not_built(kit)}")
    kernels.small_step(*args)


def amx_ready() -> bool:
    """Whether the small step can run its products on AMX tiles here: the CPU has AMX-BF16 and
    Linux granted this process its tile data (`amx.c`)."""
    kernels = _built()[0]
    return kernels is not None and kernels.amx_ready()


@functools.cache
def _fallback_once(reason: str | None, what: str = "bf16 one-row products and attention") -> None:
    log.warning("%s run through torch, slower: %s", what, reason)


# Registered with torch.library's lower-level API, not `custom_op`: a step calls it once per
# linear layer (211 times on the real model), and `custom_op` adds about 2 µs a call (its
# aliasing check), measured on 2 cores.
_LIBRARY = torch.library.Library("preheat", "FRAGMENT")
_LIBRARY.define("matvec_bf16(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("matvec_bf16", matvec, "CPU")


@torch.library.register_fake("preheat::matvec_bf16")
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


_LIBRARY.define("lora_add(Tensor x, Tensor y, Tensor a, Tensor b, Tensor columns) -> Tensor")
_LIBRARY.impl("lora_add", lora_add, "CPU")


@torch.library.register_fake("preheat::lora_add")
def _(x, y, a, b, columns):
    return y.new_empty(y.shape)
