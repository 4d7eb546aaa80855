"""The client's side of `preheat bench load`: one streamed chat completion as a client
sends it, timed from its side (every server gets these, the restart rows too), and a
load's answers summed up in a row."""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass, field

USER_INPUTS = (
    "Where is my parcel? It was due on Monday.",
    "Summarise: the launch moved to March, QA goes to Dana, the budget stays.",
    "My order arrived damaged. What are my options?",
    "Can you explain what this function returns when the list is empty?",
)


@dataclass
class Answer:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    total_s: float = 0.0
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # the server's own count of prompt tokens from its cache


def new_client(timeout: float = 600, connections: int = 16):
    """The benchmark's HTTP client, the same for every server: a connection per request.
    llama-server (cpp-httplib) closes a kept-alive connection after a few requests, and a
    request sent on one it has just closed fails ("Server disconnected without sending a
    response"): counted as the server's error, it was the client's (6 of 64 at 16 users)."""
    import httpx

    return httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=connections, max_keepalive_connections=0))


def chat(client, url, model, system_prompt, user_input, max_tokens, extra: dict | None = None) -> Answer:
    """One streamed chat completion, timed from the client's side (`extra`: a server's own fields)."""
    body = {
        **(extra or {}),
        "model": model,
        "messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": user_input}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer, started, arrivals = Answer(), time.perf_counter(), []
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                answer.error = f"{response.status_code}: {response.read().decode()[:200]}"
                return answer
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if usage := event.get("usage"):
                    answer.tokens, answer.prompt_tokens = usage.get("completion_tokens", 0), usage.get("prompt_tokens")
                    answer.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if "error" in event:
                    answer.error = str(event["error"])[:200]
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        arrivals.append(time.perf_counter())
    except Exception as exc:  # a transport failure is this request's error, counted
        answer.error = f"{type(exc).__name__}: {exc}"[:200]
    answer.total_s = time.perf_counter() - started
    if arrivals:
        answer.ttft_s = arrivals[0] - started
        answer.gaps_s = [b - a for a, b in itertools.pairwise(arrivals)]
        answer.tokens = answer.tokens or len(arrivals)  # a server that reports no usage
    elif answer.error is None:
        answer.error = "no content"
    return answer


def user_turn(k: int) -> str:
    """The k-th request's user turn: four kinds, each made unique."""
    return f"{USER_INPUTS[k % len(USER_INPUTS)]} (request {k})"


@dataclass
class Row:
    mode: str
    load: str  # "closed N users" | "poisson R/s"
    users: int
    requests: int
    errors: int
    wall_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tokens_per_s: float
    requests_per_s: float
    # Celery only: the caller's wait for the result, and the worker's own time for it.
    client_p50_ms: float | None = None
    worker_p50_ms: float | None = None
    client_over_worker_p50_ms: float | None = None
    # Cores the calling process spent while its users waited (the result backend's wait).
    caller_cores: float | None = None
    first_error: str | None = None  # what the first failed request said


def summarise(mode: str, load: str, users: int, answers: list[Answer], wall_s: float) -> Row:
    """A load's row: its answers' TTFT and gaps as percentiles, its tokens and requests a second."""
    good = [a for a in answers if a.error is None and a.ttft_s is not None]
    ttfts = [a.ttft_s * 1000 for a in good]
    gaps = [g * 1000 for a in good for g in a.gaps_s]
    failed = next((a.error for a in answers if a.error is not None), None)
    return Row(
        mode,
        load,
        users,
        len(answers),
        len(answers) - len(good),
        wall_s,
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(gaps, 50),
        percentile(gaps, 99),
        sum(a.tokens for a in good) / wall_s if wall_s else 0.0,
        len(good) / wall_s if wall_s else 0.0,
        first_error=failed,
    )


def percentile(values: list[float], p: int) -> float:
    """The nearest-rank percentile."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]
