"""`preheat infer`: one request through a warm worker, answered from its cached prefix."""

from __future__ import annotations

import json

import typer
from rich.markup import escape

from preheat.cli import render
from preheat.cli.warm import EXIT_TIMEOUT
from preheat.core.errors import ConfigError, PreheatError

console = render.console()


def infer(
    template: str = typer.Argument(..., help="Template whose system prompt starts the request."),
    user_input: str = typer.Argument(..., help="The user's message."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, max=4096, help="Most tokens to generate."),
    temperature: float | None = typer.Option(
        None, "--temperature", help="0 decodes greedily; default: the model's generation_config.json."
    ),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling: keep this much probability mass."),
    top_k: int | None = typer.Option(None, "--top-k", help="Sample among the k most likely tokens."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the sampling: the same answer every run."),
    stop: list[str] | None = typer.Option(
        None, "--stop", help="End the answer before this text (repeatable, 4 at most)."
    ),
    timeout: float = typer.Option(120.0, "--timeout", min=1.0, help="Seconds to wait for a warm worker."),
    as_json: bool = typer.Option(False, "--json", help="Print the completion as JSON."),
) -> None:
    """Send `preheat.infer` to the template's model queue (served only by workers on which it
    is warm) and print the completion with its TTFT."""
    from celery.exceptions import TimeoutError as ResultTimeout

    from preheat.celery.app import app
    from preheat.fleet.routing import send_infer

    # The router resolves the template's model queue: an unknown template fails here, unsent.
    decoding = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed, "stop": stop}
    kwargs = {"template": template, "user_input": user_input, "max_tokens": max_tokens}
    kwargs.update({name: value for name, value in decoding.items() if value is not None})
    _check_decoding(kwargs)
    # To a worker that holds the template pinned, within its bound; else the shared queue.
    call = send_infer(app, kwargs)
    try:
        answer = call.get(timeout=timeout)
    except ResultTimeout:
        call.result.revoke()
        console.print(
            f"[yellow]no warm worker answered within {timeout:.0f} s; is a worker running with "
            f"{template!r} warm? (`preheat warm`)[/]"
        )
        raise typer.Exit(EXIT_TIMEOUT) from None
    except Exception as exc:  # raised on the worker, re-raised here by Celery
        raise PreheatError(f"the worker refused the request: {exc}") from None
    finally:
        _stop_waiting(app, call.result)
    if as_json:
        print(json.dumps({**answer, "route": [route.reason for route in call.routes]}, indent=2))
        return
    console.print(answer["text"], highlight=False, markup=False)
    console.print(
        f"[dim]TTFT {answer['ttft_ms']:,.1f} ms · {answer['cached_tokens']} of {answer['prompt_tokens']} "
        f"prompt tokens from the cache · {len(answer['token_ids'])} tokens in {answer['total_ms']:,.1f} ms · "
        f"{answer['finish_reason']} · answered by {answer['worker']} ({call.route.reason})[/]"
    )


def _stop_waiting(app, pending) -> None:
    """Unsubscribe from the result now, while the interpreter is whole: left to the result's
    finalizer, the unsubscribe runs during shutdown and prints a traceback (`sys.meta_path
    is None`) after the command's own last line."""
    try:
        pending.backend.remove_pending_result(pending)
        consumer = getattr(app.backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
    except Exception as exc:  # the broker may be away: the command's outcome stands
        console.print(f"[dim]{escape(f'could not unsubscribe from the result: {exc}')}[/]")
    pending.backend = None  # nothing left for the finalizer to do


def _check_decoding(kwargs: dict) -> None:
    """The values the worker would refuse, refused here (message, exit 2), before sending:
    the same mapping the worker applies (preheat.workers.protocol)."""
    from preheat.api.requests import sampling_of
    from preheat.api.sampling import SamplingError

    fields = {k: v for k, v in kwargs.items() if k not in ("template", "user_input")}
    try:
        sampling_of(fields)
    except SamplingError as exc:
        option, why = exc.parameter.replace("_", "-"), str(exc).removeprefix(f"{exc.parameter}: ")
        raise ConfigError(f"--{option}: {why}") from None
