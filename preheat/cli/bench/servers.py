"""The servers `preheat bench load` puts under load, each fresh, on the same model and system
prompts: `preheat serve` in one of its modes, and the peers it is measured against."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

# What each preheat mode changes of a server's settings.
SERVER_ENV = {
    "batch": {},
    "one-at-a-time": {"PREHEAT_MAX_RUNNING_REQUESTS": "1"},
    "no-prefix-cache": {"PREHEAT_PREFIX_CACHING": "false"},
}


@dataclass
class Server:
    url: str
    model: str
    stop: object  # () -> None


@dataclass(frozen=True)
class Setup:
    """What every server of one run shares: the model, its precision, the rows it runs."""

    model_name: str
    model_dir: Path
    dtype: str  # float32 | bfloat16
    rows: int  # preheat's PREHEAT_MAX_RUNNING_REQUESTS and llama-server's slots
    compile: str = "auto"  # preheat's PREHEAT_COMPILE


def start(mode: str, setup: Setup, templates, catalog, folder: Path, python: Path, timeout: float) -> Server:
    if mode == "transformers":
        return start_transformers(setup.model_dir, python, folder / "logs", timeout)
    if mode == "llama-server":
        from preheat.cli.bench import llamacpp

        peer = llamacpp.start(folder / "llama.cpp", setup.model_dir, setup.dtype, setup.rows, timeout, python=python)
        return Server(peer.url, setup.model_name, peer.stop)
    return start_preheat(mode, setup, templates, catalog, folder, timeout)


def bench_catalog(folder: Path, model_name: str, model_dir: Path, templates: list[str], catalog) -> Path:
    """The catalog's templates of `model_name`, on the dev model."""
    path = folder / "catalog.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"[models.{model_name}]\npath = {json.dumps(str(model_dir))}\n"]
    for name in templates:
        text, probe = catalog.system_prompt(name), catalog.template(name).probe
        lines.append(
            f"[templates.{name}]\nmodel = {json.dumps(model_name)}\nsystem_prompt = {json.dumps(text)}\n"
            f"probe = {json.dumps(probe)}\n"
        )
    path.write_text("\n".join(lines))
    return path


def start_preheat(
    mode: str,
    setup: Setup,
    templates,
    catalog,
    folder: Path,
    timeout: float,
    prefix_store: Path | None = None,
    log_name: str | None = None,
) -> Server:
    """`preheat serve` in `mode`, ready; with no prefix store unless given one (a restart's),
    its log named for the mode unless named here."""
    import httpx

    from preheat.core import processes

    env = {
        **os.environ,
        "PREHEAT_CATALOG": str(bench_catalog(folder, setup.model_name, setup.model_dir, templates, catalog)),
        "PREHEAT_HOME": str(folder / "home"),
        "PREHEAT_PREFIX_STORE": "off" if prefix_store is None else str(prefix_store),
        "PREHEAT_DTYPE": setup.dtype,
        "PREHEAT_COMPILE": setup.compile,
        # Compiled graphs kept across runs of the bench (a restart restores them).
        "PREHEAT_COMPILE_CACHE": str(folder / "compiled"),
        "PREHEAT_MAX_RUNNING_REQUESTS": str(setup.rows),
        **SERVER_ENV[mode],
    }
    proc = processes.start_serve(env, folder / "logs", name=log_name or f"serve-{mode}")
    try:
        url = processes.serve_url(proc, timeout)
        processes.poll(lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, timeout, 0.05, "ready")
    except Exception:
        processes.kill(proc)
        raise
    return Server(url, setup.model_name, lambda: processes.stop(proc))


def start_transformers(model_dir: Path, python: Path, logs: Path, timeout: float) -> Server:
    import httpx

    from preheat.core import processes

    if not python.exists():
        raise RuntimeError(f"{python} not found: `make bench-env` installs transformers' serving extras there")
    check = subprocess.run([str(python), "-c", "import fastapi, uvicorn, transformers"], capture_output=True)
    if check.returncode:
        raise RuntimeError(f"{python} lacks transformers' serving extras (`make bench-env`)")
    port = processes.free_port()
    cli = str(python.parent / "transformers")
    argv = [cli, "serve", str(model_dir), "--continuous-batching", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = processes.start("transformers-serve", argv, env, logs)
    url = f"http://127.0.0.1:{port}"
    try:
        processes.poll(lambda: _answers(url), timeout, 0.2, "transformers serve to listen")
    except Exception:
        processes.kill(proc)
        raise RuntimeError(f"transformers serve did not start: {proc.log()[-400:]}") from None
    # It loads the model on its first request: that one is not part of any measurement.
    warm = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": str(model_dir), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=timeout,
    )
    if warm.status_code != 200:
        processes.kill(proc)
        raise RuntimeError(f"transformers serve answered {warm.status_code}: {warm.text[:300]}")
    return Server(url, str(model_dir), lambda: processes.stop(proc))


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
