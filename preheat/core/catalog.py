"""The catalog: which models a worker keeps resident, which system prompts it pre-fills,
which remote endpoints it warms, and which peaks beat warms ahead of.

It is a TOML file (``PREHEAT_CATALOG``, default ``preheat.toml``)::

    [models.tiny-llama]
    path = ".preheat/models/tiny-llama"     # a local folder; or hub_id = "org/name"

    [templates.support]
    model = "tiny-llama"
    system_prompt = "You are the support assistant of …"   # or system_prompt_file = "prompts/support.txt"
    probe = "Where is my order?"

    [endpoints.vllm-main]
    base_url = "http://vllm:8000/v1"
    templates = ["support"]

    [schedules.weekday-morning]           # copied into the schedules table by beat
    cron = "0 9 * * 1-5"                  # the peak, in timezone (default PREHEAT_TIMEZONE)
    timezone = "Europe/Berlin"
    lead_time_s = 600                     # fire ten minutes ahead
    templates = ["support"]

Relative paths are resolved against the catalog file's folder, as docker-compose does,
so the same file works from any working directory.
"""

from __future__ import annotations

import functools
import json
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from preheat.core.errors import ConfigError, UnknownNameError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


# A system prompt is text a model reads before every request: a file over this is a mistake.
MAX_PROMPT_BYTES = 4 * 1024**2


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """A model is a local folder (`path`, relative to the catalog) or a hub id (`hub_id`), never both:
    guessing which one "org/name" means would turn a typo'd folder into a download."""

    path: str | None = Field(None, min_length=1)
    hub_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
    revision: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Replaces the model's own chat template (a Jinja text, inline or in a file).
    chat_template: str | None = Field(None, min_length=1)
    chat_template_file: str | None = Field(None, min_length=1)
    # LoRA adapters of this model: name -> a PEFT adapter folder (relative to the catalog).
    # A request names one as its `model`; up to `max_adapters` are resident at once
    # (workers/adapters.py), each of rank at most `max_adapter_rank`.
    adapters: dict[str, str] = Field(default_factory=dict)
    max_adapters: int = Field(4, ge=1, le=64)
    max_adapter_rank: int = Field(64, ge=1, le=1024)

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.path is None) == (self.hub_id is None):
            raise ValueError("give exactly one of path (a local folder) or hub_id")
        if self.chat_template is not None and self.chat_template_file is not None:
            raise ValueError("give at most one of chat_template or chat_template_file")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("chat_template is blank")
        return self

    def is_local(self) -> bool:
        return self.path is not None


class TemplateSpec(_Strict):
    model: str
    system_prompt: str | None = None
    system_prompt_file: str | None = None
    probe: str = Field("Hello! What can you help me with today?", min_length=1)
    # Pre-filled (and answered) under this LoRA adapter of its model; None: the base.
    adapter: str | None = None

    @model_validator(mode="after")
    def _one_prompt_source(self) -> TemplateSpec:
        if (self.system_prompt is None) == (self.system_prompt_file is None):
            raise ValueError("give exactly one of system_prompt or system_prompt_file")
        if self.system_prompt is not None and not self.system_prompt.strip():
            raise ValueError("system_prompt is empty")
        return self


class EndpointSleepSpec(_Strict):
    """A vLLM server's sleep mode (it runs with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode):
    the level a sleep asks for, what happens to requests in flight, how long a wake may take."""

    level: Literal[1, 2] = 1
    mode: Literal["wait", "abort", "keep"] = "wait"  # wait: requests in flight finish first
    wake_timeout_s: float = Field(120.0, gt=0, le=3600)


class EndpointSpec(_Strict):
    """A model server preheat warms over HTTP: vLLM, a hosted OpenAI-compatible API, or
    another `preheat serve`. Its pool is opened ahead of time and kept alive."""

    base_url: str = Field(pattern=r"^https?://[^/\s]+")  # the API root, e.g. http://vllm:8000/v1
    kind: Literal["openai", "vllm", "preheat"] = "openai"
    model: str | None = None  # the name the server knows; default: the template's catalog model
    api_key_env: str | None = None  # the environment variable holding the API key (never the key)
    token_env: str | None = None  # kind preheat: the variable holding its PREHEAT_SERVE_TOKEN
    min_connections: int = Field(1, ge=0)
    max_connections: int = Field(10, ge=1)
    keepalive_expiry_s: float = Field(60.0, gt=0)
    http2: bool = False
    ca_bundle: str | None = None
    timeout_s: float = Field(60.0, gt=0)
    templates: list[str] = []
    max_tokens: int = Field(8, ge=1, le=4096)  # of each warmup prompt
    # The provider's prompt cache forgets a prefix unused for its TTL; keep-alive pings come
    # more often than that, only within the active hours (in `timezone`), if set.
    prompt_cache_ttl_s: float = Field(300.0, gt=0)
    keepalive_interval_s: float | None = Field(270.0, gt=0)
    active_hours: str | None = Field(None, pattern=r"^([01]\d|2[0-3]):[0-5]\d-([01]\d|2[0-4]):[0-5]\d$")
    timezone: str = "UTC"
    sleep: EndpointSleepSpec | None = None  # kind vllm: it may be put to sleep and woken
    # kind vllm: LoRA adapters a warmup loads (`POST /v1/load_lora_adapter`), name -> the
    # adapter's path as the server sees it; a template under one is primed by its name.
    adapters: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> EndpointSpec:
        if self.min_connections > self.max_connections:
            raise ValueError("min_connections exceeds max_connections")
        if self.sleep is not None and self.kind != "vllm":
            raise ValueError(f"sleep is vLLM's sleep mode; an endpoint of kind {self.kind!r} has none")
        if self.adapters and self.kind != "vllm":
            raise ValueError(f"adapters are loaded through vLLM's LoRA API; an endpoint of kind {self.kind!r} has none")
        if self.keepalive_interval_s is not None and self.keepalive_interval_s >= self.prompt_cache_ttl_s:
            raise ValueError(
                f"keepalive_interval_s ({self.keepalive_interval_s:g}) must be below prompt_cache_ttl_s "
                f"({self.prompt_cache_ttl_s:g}), or the cache expires between pings"
            )
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {self.timezone!r}") from None
        return self

    def is_active(self, moment) -> bool:
        """Whether `moment` (an aware datetime) falls within the active hours."""
        if self.active_hours is None:
            return True
        from zoneinfo import ZoneInfo

        local = moment.astimezone(ZoneInfo(self.timezone))
        start, end = self.active_hours.split("-")
        now = f"{local:%H:%M}"
        return start <= now < end if start <= end else (now >= start or now < end)


class ScheduleSpec(_Strict):
    """A schedule declared in the file; beat copies it into the schedules table (kind
    `catalog`) at start, where it fires like one added with `preheat schedule add`."""

    cron: str
    templates: list[str] = Field(min_length=1)
    timezone: str | None = None  # default: PREHEAT_TIMEZONE
    lead_time_s: int = Field(0, ge=0, le=86400)

    @model_validator(mode="after")
    def _valid_cron(self) -> ScheduleSpec:
        from preheat.core.cron import Cron

        Cron.parse(self.cron, self.timezone or "UTC")  # CronError is a ValueError: pydantic reports it
        return self


class Catalog(_Strict):
    folder: Path = Path(".")
    models: dict[str, ModelSpec] = {}
    templates: dict[str, TemplateSpec] = {}
    endpoints: dict[str, EndpointSpec] = {}
    schedules: dict[str, ScheduleSpec] = {}

    @model_validator(mode="after")
    def _names_resolve(self) -> Catalog:
        import re

        for section in ("models", "templates", "endpoints", "schedules"):
            for name in getattr(self, section):
                if not re.match(NAME_PATTERN, name):
                    raise ValueError(f"{section}.{name}: names are letters, digits, '.', '_' or '-'")
        adapters: dict[str, str] = {}
        for model, spec in self.models.items():
            for adapter, folder in spec.adapters.items():
                if not re.match(NAME_PATTERN, adapter) or not folder.strip():
                    raise ValueError(
                        f"models.{model}.adapters.{adapter}: a name (letters, digits, '.', '_', '-') = a folder"
                    )
                if adapter in self.models or adapter in adapters:
                    raise ValueError(
                        f"models.{model}.adapters.{adapter}: the name is taken (requests name it as a model)"
                    )
                adapters[adapter] = model
        for name, template in self.templates.items():
            if template.model not in self.models:
                raise ValueError(f"templates.{name}.model: unknown model {template.model!r}")
            if template.adapter is not None and adapters.get(template.adapter) != template.model:
                raise ValueError(
                    f"templates.{name}.adapter: {template.adapter!r} is no adapter of model {template.model!r}"
                )
        for section in ("endpoints", "schedules"):
            for name, spec in getattr(self, section).items():
                for template in spec.templates:
                    if template not in self.templates:
                        raise ValueError(f"{section}.{name}.templates: unknown template {template!r}")
        for name, spec in self.endpoints.items():
            for template in spec.templates:
                adapter = self.templates[template].adapter
                if adapter is not None and adapter not in spec.adapters:
                    raise ValueError(
                        f"endpoints.{name}.templates: {template!r} is under adapter {adapter!r}, "
                        f"which the endpoint does not declare (endpoints.{name}.adapters)"
                    )
        return self

    # Lookups that give the caller one clear error -------------------------------

    def model(self, name: str) -> ModelSpec:
        try:
            return self.models[name]
        except KeyError:
            raise UnknownNameError(f"unknown model {name!r} (catalog has: {_listing(self.models)})") from None

    def template(self, name: str) -> TemplateSpec:
        try:
            return self.templates[name]
        except KeyError:
            raise UnknownNameError(f"unknown template {name!r} (catalog has: {_listing(self.templates)})") from None

    def adapter_base(self, name: str) -> str:
        """The model adapter `name` belongs to; UnknownNameError if it is no adapter."""
        for model, spec in self.models.items():
            if name in spec.adapters:
                return model
        every = sorted(a for spec in self.models.values() for a in spec.adapters)
        raise UnknownNameError(f"unknown adapter {name!r} (catalog has: {', '.join(every) or 'nothing'})")

    def adapter_path(self, name: str) -> str:
        folder = self.models[self.adapter_base(name)].adapters[name]
        return str((self.folder / Path(folder).expanduser()).resolve())

    def base_and_adapter(self, name: str) -> tuple[str, str | None]:
        """What a request's `model` names: a model (itself, no adapter) or an adapter (its base,
        itself). UnknownNameError naming both lists when it is neither."""
        if name in self.models:
            return name, None
        try:
            return self.adapter_base(name), name
        except UnknownNameError:
            raise UnknownNameError(f"unknown model {name!r} (catalog has: {_listing(self.models)})") from None

    def templates_of(self, model: str) -> list[str]:
        """The names of the templates whose system prompts run on `model`."""
        return [name for name, spec in self.templates.items() if spec.model == model]

    def templates_under(self, adapter: str) -> list[str]:
        """The templates pre-filled under LoRA adapter `adapter`: what warming it warms.
        UnknownNameError for no adapter; ConfigError for one no template names."""
        self.adapter_base(adapter)
        names = [name for name, spec in self.templates.items() if spec.adapter == adapter]
        if not names:
            raise ConfigError(f"adapter {adapter!r} has no template to warm (a template with adapter = {adapter!r})")
        return names

    def models_targeted(self, targets: dict) -> set[str]:
        """The models a schedule's targets act on: those named, those of its templates, else all."""
        if targets.get("models"):
            return set(targets["models"])
        if targets.get("templates"):
            return {self.template(name).model for name in targets["templates"] if name in self.templates}
        return set(self.models)

    def endpoint(self, name: str) -> EndpointSpec:
        try:
            return self.endpoints[name]
        except KeyError:
            raise UnknownNameError(f"unknown endpoint {name!r} (catalog has: {_listing(self.endpoints)})") from None

    def model_path(self, name: str) -> str:
        """What from_pretrained loads: an absolute folder, or the hub id."""
        spec = self.model(name)
        if not spec.is_local():
            return spec.hub_id
        return str((self.folder / Path(spec.path).expanduser()).resolve())

    def system_prompt(self, name: str) -> str:
        """The template's system prompt; a prompt file that can only fail (missing, not a
        file, not UTF-8, empty or blank, over MAX_PROMPT_BYTES) is a ConfigError naming it."""
        spec = self.template(name)
        if spec.system_prompt is not None:
            return spec.system_prompt
        return self._text_file(spec.system_prompt_file, f"template {name!r}: system_prompt_file", "a system prompt")

    def chat_template(self, model: str) -> tuple[str | None, str | None]:
        """The catalog's chat template for `model` and where it is written; (None, None)
        when the catalog leaves the model its own."""
        spec = self.model(model)
        if spec.chat_template is not None:
            return spec.chat_template, f"the catalog (models.{model}.chat_template)"
        if spec.chat_template_file is None:
            return None, None
        where = f"model {model!r}: chat_template_file"
        text = self._text_file(spec.chat_template_file, where, "a chat template")
        return text, f"the catalog ({(self.folder / spec.chat_template_file).resolve()})"

    def chat_template_source(self, model: str) -> str:
        """Which chat template `model` is rendered with, told from the files alone."""
        _, source = self.chat_template(model)
        if source is not None:
            return source
        if not self.model(model).is_local():
            return "the model's own (from the hub), else preheat's default (ChatML)"
        folder = Path(self.model_path(model))
        if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
            return f"the model's own ({folder / 'chat_template.jinja'})"
        try:
            if json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"):
                return f"the model's own ({folder / 'tokenizer_config.json'})"
        except (OSError, ValueError):
            pass
        return "preheat's default (ChatML): the model has none"

    def _text_file(self, relative: str, where_of: str, what: str) -> str:
        path = (self.folder / relative).resolve()
        where = f"{where_of} {path}"
        try:
            if not path.is_file():
                raise ConfigError(f"{where} {'is not a file' if path.exists() else 'does not exist'}")
            if path.stat().st_size > MAX_PROMPT_BYTES:
                raise ConfigError(f"{where} is larger than {MAX_PROMPT_BYTES // 1024**2} MiB")
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{where} is not UTF-8 text") from None
        except OSError as exc:
            raise ConfigError(f"{where} cannot be read: {exc.strerror}") from None
        if not text.strip():
            raise ConfigError(f"{where} is {'empty' if not text else 'blank'}: it must hold {what}")
        return text

    def check_prompts(self, names: list[str] | None = None) -> None:
        """Every template's system prompt, and its model's chat template, can be read."""
        for name in names if names is not None else list(self.templates):
            self.system_prompt(name)
            self.chat_template(self.template(name).model)

    def check_model_paths(self, names: list[str] | None = None) -> None:
        """Fail early, with the path, on a local model directory that is missing or incomplete."""
        for name in names if names is not None else list(self.models):
            if not self.model(name).is_local():
                continue
            path = Path(self.model_path(name))
            if path.suffix == ".gguf":  # a GGUF file of llama.cpp's or Ollama's (workers/engine/weights.py)
                if not path.is_file():
                    raise ConfigError(f"model {name!r}: GGUF file {path} does not exist")
                continue
            if path.exists() and not path.is_dir():
                raise ConfigError(f"model {name!r}: {path} is a file, not a model directory (nor a .gguf)")
            if not path.is_dir():
                raise ConfigError(f"model {name!r}: directory {path} does not exist")
            if not (path / "config.json").is_file():
                raise ConfigError(f"model {name!r}: {path} has no config.json (not a saved transformers model)")


def _listing(mapping: dict) -> str:
    return ", ".join(sorted(mapping)) or "nothing"


def _location(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def load_catalog(path: Path) -> Catalog:
    """Read and validate a catalog file."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"catalog {path} does not exist (set PREHEAT_CATALOG)") from None
    except IsADirectoryError:
        raise ConfigError(f"catalog {path} is a directory, not a TOML file (set PREHEAT_CATALOG)") from None
    except OSError as exc:
        raise ConfigError(f"catalog {path} cannot be read: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"catalog {path}: not valid TOML: {exc}") from None
    try:
        return Catalog.model_validate({**raw, "folder": path.resolve().parent})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _location(first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigError(f"catalog {path}: {where + ': ' if where else ''}{message}") from None


def current_catalog(path: Path) -> Catalog:
    """The catalog at `path`, parsed again only when the file changed: for paths taken on
    every request (routing), where a parse per call would be waste."""
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError:
        return load_catalog(path)  # raises the one clear error
    return _parsed(path.resolve(), mtime_ns)


@functools.lru_cache(maxsize=8)
def _parsed(path: Path, mtime_ns: int) -> Catalog:
    return load_catalog(path)
