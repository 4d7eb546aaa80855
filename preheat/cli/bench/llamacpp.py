"""llama.cpp's `llama-server`, the strongest peer that runs here, built and fed for `preheat bench`.

Built from the llama-cpp-python source distribution on PyPI (its `vendor/llama.cpp`, with cmake
and ninja; `-DGGML_NATIVE=ON`, as llama.cpp builds for the machine it runs on), once, under the
bench's folder. The model is the same safetensors preheat loads, converted to GGUF at the same
precision by the converter shipped in that source (`convert_hf_to_gguf.py`, F32 or BF16),
once per model and precision. The server runs with as many slots as preheat's rows, its
prompt cache on (the default), and as many threads as the machine has cores.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

PROJECT, VERSION = "llama-cpp-python", "0.3.36"
OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}


class PeerUnavailable(RuntimeError):
    """The peer cannot be built or started here; the bench says why and measures the others."""


def source(folder: Path) -> Path:
    """llama.cpp's source as the sdist vendors it, fetched by pip once."""
    if (tree := _vendored(folder)) is not None:
        return tree
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet", "-d", work]
        done = subprocess.run([*argv, f"{PROJECT}=={VERSION}"], capture_output=True, text=True)
        if done.returncode != 0:
            raise PeerUnavailable(f"cannot download the {PROJECT} {VERSION} sdist: {done.stderr.strip()[-300:]}")
        [archive] = Path(work).glob("*.tar.gz")
        with tarfile.open(archive) as sdist:
            sdist.extractall(folder, filter="data")
    if (tree := _vendored(folder)) is not None:
        return tree
    raise PeerUnavailable(f"the {PROJECT} {VERSION} sdist holds no vendor/llama.cpp")


def _vendored(folder: Path) -> Path | None:
    # The sdist's folder is llama_cpp_python-VERSION (PEP 625 names); older ones used dashes.
    for name in ("llama_cpp_python", PROJECT):
        tree = folder / f"{name}-{VERSION}" / "vendor" / "llama.cpp"
        if (tree / "CMakeLists.txt").is_file():
            return tree
    return None


def server_binary(folder: Path) -> Path:
    """`llama-server`, built once (a few minutes on 2 cores)."""
    build = folder / "build"
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise PeerUnavailable(f"building llama-server needs {tool} (Debian: cmake, g++)")
    tree = source(folder)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        "cmake", "-S", str(tree), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
    ]  # fmt: skip
    for step in (configure, ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count())]):
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise PeerUnavailable(f"building llama-server failed: {(done.stderr or done.stdout).strip()[-400:]}")
    return binary


def gguf_of(folder: Path, model_dir: Path, dtype: str, python: Path | None = None) -> Path:
    """The model's safetensors as a GGUF at `dtype`, by llama.cpp's own converter (once), run
    by `python`: the bench's environment (`make bench-env`: torch, transformers, sentencepiece),
    so the product's stays as it ships."""
    digest = hashlib.sha256(f"{model_dir.resolve()}:{(model_dir / 'config.json').stat().st_mtime_ns}".encode())
    out = folder / "gguf" / f"{model_dir.name}-{digest.hexdigest()[:12]}-{OUTTYPES[dtype]}.gguf"
    if out.is_file():
        return out
    tree = source(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{tree / 'gguf-py'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    temporary = out.with_suffix(".tmp")
    python = python if python is not None and python.exists() else Path(sys.executable)
    argv = [str(python), str(tree / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(temporary)]
    done = subprocess.run([*argv, "--outtype", OUTTYPES[dtype]], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise PeerUnavailable(f"converting {model_dir} to GGUF failed: {done.stderr.strip()[-400:]}")
    os.replace(temporary, out)
    return out


@dataclass
class LlamaServer:
    url: str
    stop: object  # () -> None
    argv: list[str]


def start(
    folder: Path,
    model_dir: Path,
    dtype: str,
    slots: int,
    timeout: float,
    slot_save: Path | None = None,
    python: Path | None = None,
):
    """A llama-server on a free port with the model at `dtype`, `slots` slots of 2,048
    positions each, its prompt cache on, as many threads as cores; ready when it answers."""
    import httpx

    from preheat.core import processes

    binary, gguf = server_binary(folder), gguf_of(folder, model_dir, dtype, python)
    port, threads = processes.free_port(), str(os.cpu_count())
    argv = [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
        "-c", str(2048 * slots), "-t", threads, "-tb", threads, "--jinja", "--no-webui",
    ]  # fmt: skip
    if slot_save is not None:
        slot_save.mkdir(parents=True, exist_ok=True)
        argv += ["--slot-save-path", str(slot_save)]
    proc = processes.start("llama-server", argv, dict(os.environ), folder / "logs")
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        processes.poll(ready, timeout, 0.05, "llama-server to load its model")
    except Exception:
        processes.kill(proc)
        raise PeerUnavailable(f"llama-server did not start: {proc.log()[-400:]}") from None
    return LlamaServer(url, lambda: processes.stop(proc), argv)
