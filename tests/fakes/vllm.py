"""A stand-in for a vLLM OpenAI-compatible server, run as a real process over HTTP, for the
tests of endpoint sleep and wake. It speaks vLLM's own paths, parameters, bodies and metric
names; each behaviour says which vLLM release it follows:

- `POST /v1/chat/completions`, streamed (SSE `data:` chunks, `[DONE]`), with `usage` in the
  last chunk when `stream_options.include_usage`; `usage.prompt_tokens_details.cached_tokens`
  only with `--enable-prompt-tokens-details` (vLLM 0.8+; off by default, as upstream).
- Automatic prefix caching over blocks of `--block-size` tokens (16, vLLM's default): a prompt's
  cached tokens are its longest prefix of whole blocks seen before. Tokens here are words (the
  fake has no tokenizer): counts differ from a real model's, their bookkeeping does not.
- `/metrics` in Prometheus text: the counters `vllm:prefix_cache_queries_total` and
  `vllm:prefix_cache_hits_total` (in tokens, vLLM V1, 0.9+), `vllm:prompt_tokens_total`, and
  the gauge `vllm:engine_sleep_state{sleep_state=awake|weights_offloaded|discard_all}`
  (vLLM 0.11+, #24176, #27867), labels `model_name` and `engine`.
- Sleep mode (VLLM_SERVER_DEV_MODE=1 with --enable-sleep-mode; here `--dev-mode`):
  `POST /sleep?level=1|2&mode=abort|wait|keep` (mode since vLLM 0.17, #34528) answers 200 with
  an empty body and discards the KV cache (the prefix cache with it); `POST /wake_up` with
  optional `tags=weights` / `tags=kv_cache` (vLLM 0.10+); `GET /is_sleeping` ->
  `{"is_sleeping": bool}`, true until every slept tag is woken; level 2 needs
  `POST /collective_rpc {"method": "reload_weights"}` before it answers sensibly (vLLM 0.11's
  recipe), and `POST /reset_prefix_cache`. Without dev mode these paths are 404 with FastAPI's
  body `{"detail": "Not Found"}`, as upstream.
- LoRA at run time (vLLM 0.6+, `docs/features/lora.md`): with `--enable-lora` and
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (here `--runtime-lora`), `POST /v1/load_lora_adapter`
  `{"lora_name", "lora_path"}` answers 200 with the text `Success: LoRA adapter '<name>' added
  successfully.`; a name already loaded, or a path with no adapter_config.json, is 400 with
  vLLM's error body (`{"object": "error", "message", "type": "BadRequestError", "code": 400}`);
  `POST /v1/unload_lora_adapter` `{"lora_name"}` likewise; without runtime updating both paths
  are 404 (the routes are not registered). `GET /v1/models` lists the base and each adapter with
  `parent` (the base) and `root` (its path); a chat naming an unknown model is 404
  (`NotFoundError`), and the prefix cache keys blocks by the model (an adapter's never hit the
  base's, as vLLM's block hashes include the LoRA).
- A request while asleep: upstream has varied (a crash in 2025-03, #14311; held by the paused
  scheduler since #34528); the fake refuses it with 503, which is what preheat must never cause.

Knobs for faults: `--wake-delay-s` (how long `/is_sleeping` stays true after a wake),
`--wake-never` (it never wakes: a wake that times out), `--metrics missing|garbage` (/metrics
404 as behind a proxy that hides it, or text no Prometheus parser reads), `--is-sleeping-garbage`
(`/is_sleeping` answers a body that is not JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import tornado.web

MODEL = "fake-model"


class State:
    def __init__(self, args) -> None:
        self.args = args
        self.blocks: set[tuple[str, ...]] = set()  # cached prefixes, whole blocks
        self.queries = self.hits = self.prompt_tokens = 0
        self.level = 0  # 0 awake, 1 weights offloaded, 2 discarded
        self.asleep_tags: set[str] = set()
        self.weights_valid = True
        self.awake_at = 0.0  # monotonic time /is_sleeping turns false after a wake
        self.sleeps: list[dict] = []  # every /sleep call, as received
        self.is_sleeping_calls = 0
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded: name -> path

    def is_sleeping(self) -> bool:
        if self.asleep_tags:
            return True
        return time.monotonic() < self.awake_at

    def cached(self, tokens: list[str], model: str = MODEL) -> int:
        """Blocks are keyed by the model too: an adapter's never match the base's."""
        size = self.args.block_size
        hit = 0
        for end in range(size, len(tokens) + 1, size):
            if (model, *tokens[:end]) in self.blocks:
                hit = end
            else:
                break
        for end in range(size, len(tokens) + 1, size):
            self.blocks.add((model, *tokens[:end]))
        return hit


class Base(tornado.web.RequestHandler):
    @property
    def state(self) -> State:
        return self.application.settings["state"]

    def send_json(self, status: int, body) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def dev_only(self) -> bool:
        if not self.state.args.dev_mode:
            self.send_json(404, {"detail": "Not Found"})
            return False
        return True


class Chat(Base):
    async def post(self) -> None:
        state = self.state
        if state.is_sleeping():
            self.send_json(503, {"error": {"message": "the engine is sleeping", "type": "ServiceUnavailable"}})
            return
        if not state.weights_valid:
            self.send_json(500, {"error": {"message": "weights were discarded (level 2): reload_weights first"}})
            return
        body = json.loads(self.request.body)
        if body.get("model") not in (MODEL, *state.adapters):
            error = {
                "object": "error",
                "message": f"The model `{body.get('model')}` does not exist.",
                "type": "NotFoundError",
                "code": 404,
            }
            self.send_json(404, error)
            return
        tokens = " ".join(f"{m['role']}: {m['content']}" for m in body["messages"]).split()
        cached = state.cached(tokens, body["model"])
        state.queries += len(tokens)
        state.hits += cached
        state.prompt_tokens += len(tokens)
        await asyncio.sleep(0.002 * (len(tokens) - cached) + 0.001)  # pre-fill: what the cache saves
        self.set_header("Content-Type", "text/event-stream")
        words = ["Hello", " there", "!", " How", " can", " I", " help", "?"][: body.get("max_tokens", 8)]
        for word in words:
            chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": body["model"]}
            chunk["choices"] = [{"index": 0, "delta": {"content": word}, "finish_reason": None}]
            self.write(f"data: {json.dumps(chunk)}\n\n")
            await self.flush()
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": len(tokens),
                "completion_tokens": len(words),
                "total_tokens": len(tokens) + len(words),
            }
            if state.args.enable_prompt_tokens_details:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            self.write(f"data: {json.dumps({'id': 'chatcmpl-fake', 'choices': [], 'usage': usage})}\n\n")
        self.write("data: [DONE]\n\n")
        self.finish()


class Sleep(Base):
    def post(self) -> None:
        if not self.dev_only():
            return
        level = int(self.get_argument("level", "1"))
        mode = self.get_argument("mode", "abort")
        if level not in (0, 1, 2) or mode not in ("abort", "wait", "keep"):
            self.send_json(400, {"detail": f"bad level {level} or mode {mode}"})
            return
        state = self.state
        state.sleeps.append({"level": level, "mode": mode})
        state.level = level
        state.asleep_tags = {"weights", "kv_cache"}
        state.blocks.clear()  # the KV cache is discarded, and the prefix cache with it
        if level == 2:
            state.weights_valid = False
        self.set_status(200)
        self.finish()


class WakeUp(Base):
    def post(self) -> None:
        if not self.dev_only():
            return
        state = self.state
        tags = self.get_arguments("tags") or ["weights", "kv_cache"]
        if not state.args.wake_never:
            state.asleep_tags -= set(tags)
            if not state.asleep_tags:
                state.awake_at = time.monotonic() + state.args.wake_delay_s
        self.set_status(200)
        self.finish()


class IsSleeping(Base):
    def get(self) -> None:
        if self.dev_only():
            self.state.is_sleeping_calls += 1
            if self.state.args.is_sleeping_garbage:
                self.set_status(200)
                self.finish("<html>upstream hiccup</html>")
                return
            self.send_json(200, {"is_sleeping": self.state.is_sleeping()})


class CollectiveRpc(Base):
    def post(self) -> None:
        if not self.dev_only():
            return
        method = json.loads(self.request.body or b"{}").get("method")
        if method == "reload_weights":
            self.state.weights_valid = True
        self.send_json(200, {"results": [None]})


class ResetPrefixCache(Base):
    def post(self) -> None:
        if self.dev_only():
            self.state.blocks.clear()
            self.set_status(200)
            self.finish()


class Health(Base):
    def get(self) -> None:
        self.set_status(200)
        self.finish()


class Metrics(Base):
    def get(self) -> None:
        state, labels = self.state, f'engine="0",model_name="{MODEL}"'
        if state.args.metrics == "missing":
            self.send_json(404, {"detail": "Not Found"})
            return
        if state.args.metrics == "garbage":
            self.finish("vllm:engine_sleep_state{{{ not prometheus\n")
            return
        lines = [
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(state.queries)}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(state.hits)}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(state.prompt_tokens)}",
            "# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping.",
            "# TYPE vllm:engine_sleep_state gauge",
        ]
        current = state.level if state.is_sleeping() else 0
        for level, name in enumerate(("awake", "weights_offloaded", "discard_all")):
            value = 1.0 if level == current else 0.0
            lines.append(f'vllm:engine_sleep_state{{{labels},sleep_state="{name}"}} {value}')
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish("\n".join(lines) + "\n")


def _bad_request(handler: Base, message: str) -> None:
    handler.send_json(400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400})


class LoadLora(Base):
    def post(self) -> None:
        if not self.state.args.runtime_lora:
            self.send_json(404, {"detail": "Not Found"})
            return
        body = json.loads(self.request.body or b"{}")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            _bad_request(self, "Both 'lora_name' and 'lora_path' must be provided.")
        elif name in self.state.adapters:
            _bad_request(self, f"The lora adapter '{name}' has already been loaded.")
        elif not (Path(path) / "adapter_config.json").is_file():
            _bad_request(self, f"Loading lora {name} failed: No adapter found for {path}")
        else:
            self.state.adapters[name] = path
            self.finish(f"Success: LoRA adapter '{name}' added successfully.")


class UnloadLora(Base):
    def post(self) -> None:
        if not self.state.args.runtime_lora:
            self.send_json(404, {"detail": "Not Found"})
            return
        name = json.loads(self.request.body or b"{}").get("lora_name")
        if name not in self.state.adapters:
            _bad_request(self, f"The lora adapter '{name}' cannot be found.")
            return
        del self.state.adapters[name]
        self.finish(f"Success: LoRA adapter '{name}' removed successfully.")


class Models(Base):
    def get(self) -> None:
        data = [{"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL, "parent": None}]
        for name, path in self.state.adapters.items():
            data.append({"id": name, "object": "model", "owned_by": "vllm", "root": path, "parent": MODEL})
        self.send_json(200, {"object": "list", "data": data})


class Calls(Base):
    """Not vLLM's: what the tests read back (every /sleep call, as received)."""

    def get(self) -> None:
        self.send_json(200, {"sleeps": self.state.sleeps, "is_sleeping_calls": self.state.is_sleeping_calls})


def make_app(args) -> tornado.web.Application:
    return tornado.web.Application(
        [
            (r"/v1/chat/completions", Chat),
            (r"/v1/models", Models),
            (r"/v1/load_lora_adapter", LoadLora),
            (r"/v1/unload_lora_adapter", UnloadLora),
            (r"/sleep", Sleep),
            (r"/wake_up", WakeUp),
            (r"/is_sleeping", IsSleeping),
            (r"/collective_rpc", CollectiveRpc),
            (r"/reset_prefix_cache", ResetPrefixCache),
            (r"/health", Health),
            (r"/metrics", Metrics),
            (r"/fake/calls", Calls),
        ],
        state=State(args),
    )


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(description="A faithful stand-in for vLLM's OpenAI server and sleep mode")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dev-mode", action="store_true", help="VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--wake-delay-s", type=float, default=0.0)
    parser.add_argument("--wake-never", action="store_true")
    parser.add_argument("--metrics", choices=("ok", "missing", "garbage"), default="ok")
    parser.add_argument("--is-sleeping-garbage", action="store_true")
    parser.add_argument("--runtime-lora", action="store_true", help="--enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    return parser.parse_args(argv)


async def serve(argv: list[str]) -> None:
    import tornado.netutil

    args = parse(argv)
    [socket] = tornado.netutil.bind_sockets(args.port, "127.0.0.1")
    server = tornado.httpserver.HTTPServer(make_app(args))
    server.add_sockets([socket])
    print(f"fake vllm listening on http://127.0.0.1:{socket.getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    import tornado.httpserver

    asyncio.run(serve(sys.argv[1:]))
