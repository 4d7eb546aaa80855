"""The compile store's identity, without compiling: what a stored graph depends on is in it,
so a graph stored by another transformers or another preheat engine is never loaded."""

from __future__ import annotations

import hashlib
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
