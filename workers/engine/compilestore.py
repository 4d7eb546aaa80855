"""Compiled graphs kept on disk: a restarted worker loads them instead of compiling again.

What a compile leaves in this process's folder (inductor's cache folder, `process_folder`):
each step's graph, saved by torch.compile's ahead-of-time API (preheat.workers.engine.compiled,
in `graphs_folder`), and the C++ kernels built for them, which a loaded graph calls. That folder
is pickles and shared libraries: what comes back from disk is untrusted, and a damaged or
foreign one would be loaded as code. So each process compiles into a folder of its own
(`PREHEAT_HOME` never), and the store holds, per model and everything a graph depends on (its
*identity*: torch, transformers and Python versions, the code of preheat's that a graph
bakes in, the device and its instruction set, the dtype, the model's content digest and name,
the graphs' shapes), a copy of the files that model's
compile added, with a manifest of their SHA-256. A restore proves the manifest is this
identity's and every file is whole before copying them into the process's folder; anything
else (a flipped byte, a file missing, another machine's kernels) costs a compile, never a
crash or a wrong answer, and the entry is written again. Entries are written under a
temporary name and renamed, so replicas on one volume share them and never read half of one.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from preheat.workers.engine.device import cpu_flags, pick_placement

log = logging.getLogger(__name__)

FORMAT = "preheat-compiled/1"
MANIFEST = "manifest.json"
_PROCESS_FOLDER: list[Path] = []  # inductor's cache folder of this process (set once)
_LOCK = threading.Lock()
_PROBES: list[threading.Thread] = []  # inductor's ISA probe, started ahead (probe_ahead)


def process_folder() -> Path:
    """This process's own inductor cache folder, set before its first compile."""
    with _LOCK:
        if not _PROCESS_FOLDER:
            folder = Path(tempfile.mkdtemp(prefix="preheat-inductor-"))
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
            atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the store keeps what is worth keeping
            _PROCESS_FOLDER.append(folder)
        return _PROCESS_FOLDER[0]


def identity(device, dtype, model_digest: str, shapes: str, owner: str) -> dict[str, str]:
    """Everything a compiled graph of the model depends on; `owner`, the model's name, too:
    its graphs name its packed weights by it."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        hardware = f"{name} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    else:
        hardware = f"{platform.machine()} {' '.join(sorted(cpu_flags()))}"
    import transformers

    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "transformers": transformers.__version__,  # its modeling code is traced into the graphs
        "engine": engine_digest(),
        "python": sys.version.split()[0],
        "device": device.type,
        "hardware": hashlib.sha256(hardware.encode()).hexdigest(),
        "dtype": str(dtype),
        "model": model_digest,
        "shapes": shapes,
        "owner": owner,
    }


# preheat's modules whose code a graph holds once compiled (the linear layers, the traced
# forward, the adapters' stacks): a graph stored by another version of them would run that
# version's code, so their source is part of the identity.
GRAPH_CODE = ("compiled.py", "aotgraph.py", "linears.py", "lorastack.py", "attention.py", "cpukernels.py")


@functools.cache
def engine_digest() -> str:
    digest = hashlib.sha256()
    for name in GRAPH_CODE:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:16]


def graphs_folder(key: dict[str, str]) -> Path:
    """Where the compiled steps of `key` are saved and loaded: in this process's folder,
    beside the kernels they call, so a store's entry keeps both."""
    return process_folder() / "graphs" / _digest(key)


def _digest(key: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]


class CompileStore:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def entry(self, key: dict[str, str]) -> Path:
        return self.folder / _digest(key)

    def restore(self, key: dict[str, str]) -> bool:
        """The entry of `key` proven and copied into this process's folder; False when there
        is none or it is unusable (then removed, with one log line)."""
        entry = self.entry(key)
        if not (entry / MANIFEST).is_file():
            return False
        try:
            files = self._proven(entry, key)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("compiled graphs in %s are unusable (%s): removed; compiling", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
            return False
        into = process_folder()
        for name in files:
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                shutil.copyfile(entry / "files" / name, target)
        return True

    def _proven(self, entry: Path, key: dict[str, str]) -> dict[str, str]:
        manifest = json.loads((entry / MANIFEST).read_text())
        if manifest.get("identity") != key:
            raise ValueError("compiled for another identity")
        files = manifest["files"]
        for name, digest in files.items():
            path = entry / "files" / name
            if not _inside(name):
                raise ValueError(f"{name} is outside the entry")
            if _sha256(path) != digest:
                raise ValueError(f"{name} is not what was written (its SHA-256 differs)")
        return files

    @staticmethod
    def _listed(entry: Path) -> set[str]:
        """The names an entry's manifest lists that lie inside the entry; none if unreadable."""
        try:
            names = json.loads((entry / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return set()
        return {name for name in names if _inside(name)}

    def publish(self, key: dict[str, str], before: set[str]) -> Path | None:
        """The files this process's folder gained since `before` (one model's restore and
        compile: what the entry held and what it lacked), stored as the entry of `key`, an
        entry already there swapped for it whole (a reader that loses that race compiles).
        Best effort: a full disk is a log line, never raised."""
        folder, entry = process_folder(), self.entry(key)
        added = snapshot() - before
        if not added:
            return None
        # The entry's own files this process already held before (a wake's restore copies
        # none): kept, so the entry stored again is never smaller than the one it replaces.
        added = sorted(added | {name for name in self._listed(entry) if (folder / name).is_file()})
        temporary = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
        try:
            files = {}
            for name in added:
                target = temporary / "files" / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / name, target)
                files[name] = _sha256(target)
            (temporary / MANIFEST).write_text(json.dumps({"identity": key, "files": files}, indent=1))
            if entry.exists():  # a directory is renamed over an empty one only
                aside = entry.with_name(f".{entry.name}.{os.getpid()}.old")
                os.replace(entry, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.replace(temporary, entry)
        except OSError as exc:
            log.warning("compiled graphs not stored in %s: %s", self.folder, exc)
            shutil.rmtree(temporary, ignore_errors=True)
            return None
        return entry


def probe_ahead(mode: str, preference: str) -> threading.Thread | None:
    """Start what inductor asks before it loads a graph on the CPU, on a thread of its own, so
    that it runs while the weights are read: the CPU's vector ISA, proven by compiling and
    loading a probe for each candidate in child processes (1.3 s of a 3.5 s restore of the
    real model's graphs, 2 cores). inductor keeps the answer for the process. Its modules are
    imported here, on the caller's thread: two threads importing one package could deadlock.
    `mode` and `preference`: PREHEAT_COMPILE and PREHEAT_DEVICE (nothing to do unless steps
    are compiled on the CPU)."""
    import torch

    from preheat.workers.engine.compiled import why_not_compiled

    if mode != "auto" or preference == "cuda" or pick_placement(preference).device.type != "cpu":
        return None
    if why_not_compiled(torch.device("cpu")) is not None:
        return None
    from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401

    def probe() -> None:
        try:
            cpu_vec_isa.valid_vec_isa_list()
        except Exception as exc:  # the restore probes again, and says what fails
            log.debug("inductor's ISA probe ahead failed: %s", exc)

    thread = threading.Thread(target=probe, name="preheat-isa-probe", daemon=True)
    thread.start()
    _PROBES.append(thread)
    return thread


def probed() -> None:
    """Once the probe started ahead is done: a compile or a load then finds its answer (else
    it would probe again beside it), and the files it built are not taken for a graph's."""
    while _PROBES:
        _PROBES.pop().join()


def snapshot() -> set[str]:
    """The files in this process's inductor folder now (relative names)."""
    folder = process_folder()
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file() and "lock" not in path.name}


def _inside(name: str) -> bool:
    """Whether a manifest's file `name` stays inside its folder (untrusted: it came from disk)."""
    return not Path(name).is_absolute() and ".." not in Path(name).parts


def libraries(names: set[str]) -> set[str]:
    """The compiled kernels (shared libraries) among a folder's relative `names`."""
    return {name for name in names if name.endswith(".so")}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
