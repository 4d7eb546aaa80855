"""The compile store's identity, without compiling: what a stored graph depends on is in it,
so a graph stored by another transformers or another preheat engine is never loaded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import transformers

from preheat.workers.engine import compilestore


def test_the_identity_names_transformers_and_the_engine_code_a_graph_bakes_in():
    key = compilestore.identity(torch.device("cpu"), torch.float32, "digest", "one,many/1", "m")
    assert key["transformers"] == transformers.__version__ and key["torch"] == torch.__version__
    folder = Path(compilestore.__file__).parent
    expected = hashlib.sha256(b"".join((folder / name).read_bytes() for name in compilestore.GRAPH_CODE))
    assert key["engine"] == expected.hexdigest()[:16]
    # Another version of any of those files is another identity: another entry of the store.
    other = dict(key, engine="0" * 16)
    store = compilestore.CompileStore(Path("/nonexistent"))
    assert store.entry(other) != store.entry(key)


def test_inductors_isa_probe_runs_ahead_only_where_steps_are_compiled_on_the_cpu():
    """At start, while the weights are read, the probe inductor runs before loading a graph is
    done on a thread of its own, and kept for the process; not where nothing compiles on a CPU."""
    from torch._inductor import cpu_vec_isa

    assert compilestore.probe_ahead("off", "auto") is None
    assert compilestore.probe_ahead("auto", "cuda") is None
    thread = compilestore.probe_ahead("auto", "cpu")
    if thread is None:  # no C++ compiler here: nothing compiles, nothing to probe
        from preheat.workers.engine.compiled import why_not_compiled

        assert why_not_compiled(torch.device("cpu")) is not None
        return
    thread.join(120)
    assert not thread.is_alive()
    probed = cpu_vec_isa.valid_vec_isa_list.cache_info()
    cpu_vec_isa.valid_vec_isa_list()
    assert probed.currsize == 1 and cpu_vec_isa.valid_vec_isa_list.cache_info().hits == probed.hits + 1


def test_an_entry_stored_again_keeps_the_files_it_held_and_never_lists_a_path_outside(tmp_path):
    """A wake in the same process restores nothing (its folder holds the entry's files): what it
    makes is stored beside them, not instead of them. Names a manifest lists outside the folder
    are never taken in."""
    folder = compilestore.process_folder()
    key = compilestore.identity(torch.device("cpu"), torch.float32, "keep-test", "one,many/1", "keep")
    held = f"graphs/{compilestore._digest(key)}/one.pt2"
    (folder / held).parent.mkdir(parents=True, exist_ok=True)
    (folder / held).write_bytes(b"held")
    store = compilestore.CompileStore(tmp_path / "store")
    store.publish(key, set())  # the first entry: what this process made
    entry = store.entry(key)
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["files"]["../outside"] = "0" * 64
    (entry / "manifest.json").write_text(json.dumps(manifest))

    before = compilestore.snapshot()  # the wake starts here: nothing to copy, all held
    made = f"graphs/{compilestore._digest(key)}/many.pt2"
    (folder / made).write_bytes(b"made")
    store.publish(key, before)
    files = json.loads((entry / "manifest.json").read_text())["files"]
    assert set(files) >= {held, made} and "../outside" not in files
    assert store.restore(key)
