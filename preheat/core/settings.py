"""One typed settings object for every preheat process.

Values come from the environment (prefix ``PREHEAT_``) or a ``.env`` file; the model
catalog (models, system-prompt templates, endpoints) comes from a TOML file named by
``PREHEAT_CATALOG``. Anything invalid fails at start with one line naming the setting:
a worker that starts on a typo'd broker URL and then retries forever is worse than one
that refuses to start.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import ByteSize, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from preheat.core.errors import ConfigError

BROKER_SCHEMES = {"filesystem", "redis", "rediss", "sentinel", "amqp", "amqps", "memory"}
DATABASE_DRIVERS = {"sqlite", "postgresql", "postgresql+psycopg"}


class Settings(BaseSettings):
    # Durations are finite and bounded (at most a year): inf or 1e300 would overflow later,
    # half-way through a command, instead of here with the variable named.
    model_config = SettingsConfigDict(env_prefix="PREHEAT_", env_file=".env", extra="ignore", allow_inf_nan=False)

    home: Path = Field(Path(".preheat"), description="State of the embedded default: broker folders, SQLite DB.")
    catalog: Path = Field(Path("preheat.toml"), description="TOML file naming models, templates and endpoints.")
    broker_url: SecretStr | None = Field(None, description="Celery broker; default: filesystem transport in home.")
    database_url: SecretStr | None = Field(None, description="History DB; default: SQLite in home.")
    timezone: str = "UTC"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # How weights are read (workers/engine/weights.py): by name from the safetensors files,
    # transformers' own loading, or the Run:ai Model Streamer (the fast-load extra); auto reads
    # by name on the CPU, the streamer for CUDA where installed, else transformers' loading.
    weight_loader: Literal["auto", "transformers", "safetensors", "runai-streamer"] = "auto"
    # The precision models compute in, unless the catalog names one: auto is bfloat16 where
    # the hardware computes it (CUDA; a CPU with avx512_bf16 or AMX), else float32.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Each model's steps as compiled graphs (workers/engine/compiled.py), compiled at start
    # before the worker is ready, and kept in compile_cache (a folder, default home/compiled;
    # a volume shared by replicas shares them; "off" keeps none): auto, or off (eager).
    compile: Literal["auto", "off"] = "auto"
    compile_cache: str | None = Field(None, min_length=1, description="Compiled graphs folder, or off.")
    # The longest warmup we expect; Redis redelivers unacked messages after the visibility
    # timeout, so it must be larger or a slow warmup runs twice.
    warmup_time_limit_s: int = Field(1800, gt=0, le=31_536_000)
    visibility_timeout_s: int = Field(7200, gt=0, le=31_536_000)
    probe_repeats: int = Field(3, ge=1, le=50, description="Probe runs per TTFT figure; the median is kept.")
    # A job is `warm` when its warm and bare TTFT are within this factor of the worker's
    # recent probes of the prefix (workers/warmup.py, `timing_error`): a busy worker is
    # slowed by a fraction, a throttled one several-fold.
    warm_factor: float = Field(3.0, gt=1.0, le=1000)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # Every worker writes a heartbeat to the registry table; one silent for longer than
    # worker_dead_after_s is dead: not sent warmups, and its unfinished jobs become `lost`.
    heartbeat_interval_s: float = Field(10.0, gt=0, le=31_536_000)
    # Every database call of a preheat process is bounded by this (connect, pool checkout,
    # each statement on the server, and a watchdog for a server that answers nothing), so
    # a stalled Postgres costs a worker this long, then its write waits in the outbox.
    # Migrations are not bounded.
    db_timeout_s: float = Field(5.0, gt=0, le=3600)
    # A job queued for a live worker that has sat idle this long since is `lost`: its
    # message never reached the worker (a Redis restart without persistence). At least
    # twice the heartbeat interval: idleness is seen through heartbeats.
    lost_message_after_s: float = Field(120.0, gt=0, le=86400)
    worker_dead_after_s: float = Field(45.0, gt=0, le=31_536_000)
    # Routing (preheat.fleet.routing): a request goes to the worker holding its prefix unless that
    # worker has this many requests waiting behind a full batch (its rows, PREHEAT_MAX_RUNNING_REQUESTS,
    # all running); then to the model's shared queue.
    route_max_waiting: int = Field(2, ge=0, le=100_000)
    # A request sent to one worker's queue that it has not started this long after is sent
    # again to the shared queue (the worker died, or stopped, with it queued).
    route_take_s: float = Field(3.0, gt=0, le=3600)
    # How long the router remembers which worker holds a conversation's turn or an ad hoc
    # system prompt (an LRU entry there may be gone sooner: the next turn is then a miss).
    route_held_ttl_s: float = Field(1800.0, gt=0, le=31_536_000)
    # Off only to measure what routing gives (`preheat bench route`): every request to the shared queue.
    routing: bool = True
    # Off only to measure what gating prevents (`preheat bench first-request`): a worker
    # then consumes inference queues from start, cold models and all.
    gate_inference: bool = True
    # The KV prefix cache of each worker process (see workers/kvcache.py).
    kv_cache_max_entries: int = Field(10, ge=1, description="Most cached prefixes per worker process.")
    kv_cache_max_bytes: ByteSize = Field(
        ByteSize(4 * 1024**3), gt=0, description="Byte budget of the cached key/value tensors (e.g. 4GiB)."
    )
    kv_cache_pinned_share: float = Field(
        0.5, ge=0.0, le=1.0, description="Share of either budget that pinned templates may hold."
    )
    # Pre-filled prefixes kept on disk (workers/prefixstore.py): a folder, default
    # home/prefixes; a volume shared by replicas shares them; "off" keeps none.
    prefix_store: str | None = Field(None, min_length=1, description="Prefix store folder, or off.")
    prefix_store_max_bytes: ByteSize = Field(
        ByteSize(16 * 1024**3), gt=0, description="Byte budget of the prefix store on disk (e.g. 16GiB)."
    )
    # Retired: every request goes through the scheduler (workers/scheduler.py). Refused by
    # name, so a deployment that still sets it learns what replaced it.
    engine: str | None = None
    # The scheduler: requests run together, each from its cached prefix; how many follows
    # the KV their rows may need (running_kv_max_bytes), up to max_running_requests.
    max_running_requests: int = Field(
        64, ge=1, le=4096, description="Requests running together per model, at most (the KV budget decides below)."
    )
    running_kv_max_bytes: ByteSize = Field(
        ByteSize(2 * 1024**3),
        gt=0,
        description="KV bytes a model's running requests may need, each as long as its prompt and max_tokens.",
    )
    max_queued_requests: int = Field(64, ge=1, le=1_000_000, description="Requests waiting; more get a 429.")
    prefill_tokens_per_step: int = Field(
        128, ge=1, le=1_000_000, description="Prompt tokens a step computes beside its decoding requests."
    )
    # Off only to measure what the cached prefixes give (`preheat bench load`): every
    # request then computes its whole prompt.
    prefix_caching: bool = True
    # Sleep and wake (workers/sleep.py): a sleep waits this long for the model's running and
    # waiting requests to finish, then is refused (never cuts one). While every model of a
    # worker sleeps it looks at its models' queues this often, and wakes for a waiting request.
    sleep_drain_s: float = Field(30.0, ge=0, le=3600, description="Seconds a sleep waits for running requests.")
    # 50 ms: a request to a sleeping model starts its wake within a tenth of a second (the
    # look is one LLEN / passive queue_declare per sleeping model, and only while one sleeps).
    wake_on_demand_poll_s: float = Field(
        0.05, gt=0, le=60, description="Seconds between looks at a sleeping model's queue."
    )
    # The worker's health server (/health/live, /health/ready, /metrics); 0 picks a free port.
    health_host: str = "0.0.0.0"
    health_port: int = Field(9440, ge=0, le=65535)
    # Where `preheat.infer` results go; default: Redis when the broker is Redis, else files in home.
    result_backend_url: SecretStr | None = None
    # `preheat serve`, the OpenAI-compatible model server. /internal/* needs the token (and
    # is refused while none is set); /v1/* needs the API key when one is set.
    serve_host: str = "0.0.0.0"
    serve_port: int = Field(8000, ge=0, le=65535)
    serve_token: SecretStr | None = None
    serve_api_key: SecretStr | None = None
    serve_max_body_bytes: ByteSize = Field(ByteSize(1024**2), gt=0)
    serve_tls_cert: Path | None = None
    serve_tls_key: Path | None = None
    # A worker's history writes wait here while the database is away (preheat/outbox.py);
    # default: home/outbox. Keep it on a volume that outlives the container.
    outbox_dir: Path | None = None
    # Beat (schedules/beat.py): it reads the schedules table every tick; the leader holds a
    # lease it renews each tick, and a standby takes over once the lease has expired.
    beat_tick_s: float = Field(1.0, gt=0, le=60)
    beat_lease_s: float = Field(15.0, gt=0, le=31_536_000)
    # A slot whose fire time passed longer ago than this (no beat ran) is `missed`, not fired.
    schedule_grace_s: float = Field(300.0, ge=0, le=31_536_000)
    # The leading beat prunes history older than this once it takes the lead and daily after
    # (preheat/prune.py; `preheat db prune` by hand); 0 keeps everything.
    history_retention_days: int = Field(90, ge=0, le=36_500)

    @field_validator("broker_url")
    @classmethod
    def _broker_url_is_usable(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return value
        parts = urlsplit(value.get_secret_value())
        if parts.scheme not in BROKER_SCHEMES:
            raise ValueError(f"scheme {parts.scheme or '(none)'!r} is not one of {sorted(BROKER_SCHEMES)}")
        if parts.scheme in {"redis", "rediss", "amqp", "amqps"}:
            if not parts.hostname:
                raise ValueError("has no host (expected e.g. redis://127.0.0.1:6379/0)")
            try:
                parts.port  # noqa: B018 - raises on a non-numeric port
            except ValueError as exc:
                raise ValueError(f"has an invalid port ({exc})") from None
            db = parts.path.lstrip("/")
            if parts.scheme.startswith("redis") and db and not db.isdigit():
                raise ValueError(f"database index {db!r} is not a number")
        return value

    @field_validator("database_url")
    @classmethod
    def _database_url_is_usable(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return value
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(value.get_secret_value())
        except ArgumentError:
            raise ValueError("is not a database URL (expected postgresql+psycopg://… or sqlite:///…)") from None
        if url.drivername not in DATABASE_DRIVERS:
            raise ValueError(f"driver {url.drivername!r} is not one of {sorted(DATABASE_DRIVERS)}")
        return value

    @field_validator("engine")
    @classmethod
    def _engine_is_retired(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError(
                "was removed: every request goes through the batching scheduler; "
                "PREHEAT_MAX_RUNNING_REQUESTS=1 decodes one request at a time"
            )

    @field_validator("timezone")
    @classmethod
    def _timezone_exists(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r}") from None
        return value

    @model_validator(mode="after")
    def _visibility_outlasts_warmup(self) -> Settings:
        if self.visibility_timeout_s <= self.warmup_time_limit_s:
            raise ValueError(
                f"PREHEAT_VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}) must exceed PREHEAT_WARMUP_TIME_LIMIT_S "
                f"({self.warmup_time_limit_s}), or Redis re-delivers warmups that are still running"
            )
        return self

    @model_validator(mode="after")
    def _dead_after_spans_heartbeats(self) -> Settings:
        if self.worker_dead_after_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"PREHEAT_WORKER_DEAD_AFTER_S ({self.worker_dead_after_s:g}) must be at least twice "
                f"PREHEAT_HEARTBEAT_INTERVAL_S ({self.heartbeat_interval_s:g}), or one late heartbeat "
                f"declares a live worker dead"
            )
        if self.lost_message_after_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"PREHEAT_LOST_MESSAGE_AFTER_S ({self.lost_message_after_s:g}) must be at least twice "
                f"PREHEAT_HEARTBEAT_INTERVAL_S ({self.heartbeat_interval_s:g}): a worker's idleness is seen "
                f"through its heartbeats"
            )
        return self

    @model_validator(mode="after")
    def _lease_spans_ticks(self) -> Settings:
        if self.beat_lease_s < 3 * self.beat_tick_s:
            raise ValueError(
                f"PREHEAT_BEAT_LEASE_S ({self.beat_lease_s:g}) must be at least three times PREHEAT_BEAT_TICK_S "
                f"({self.beat_tick_s:g}), or a leader loses its lease between two renewals"
            )
        return self

    @model_validator(mode="after")
    def _tls_cert_with_key(self) -> Settings:
        if (self.serve_tls_cert is None) != (self.serve_tls_key is None):
            raise ValueError("PREHEAT_SERVE_TLS_CERT and PREHEAT_SERVE_TLS_KEY go together: set both or neither")
        return self

    # Derived values ---------------------------------------------------------------

    @property
    def task_time_limit_s(self) -> int:
        """The hard limit: the soft limit plus a minute to record the failure."""
        return self.warmup_time_limit_s + 60

    @property
    def is_embedded(self) -> bool:
        return self.broker_url is None

    @property
    def prefix_store_folder(self) -> Path | None:
        """The prefix store's folder (None: off). Checked by the processes that open it (a
        worker, `preheat serve`, `preheat config check`), not by every process that reads
        settings: a CLI that never opens the store does not refuse to run for it."""
        if self.prefix_store is not None and self.prefix_store.strip().lower() == "off":
            return None
        folder = Path(self.prefix_store or self.home / "prefixes").expanduser().resolve()
        if folder.exists() and not folder.is_dir():
            raise ConfigError(
                f"invalid setting PREHEAT_PREFIX_STORE: {folder} is a file, not a folder: "
                "the prefix store keeps one file per prefix"
            )
        return folder

    @property
    def compile_cache_folder(self) -> Path | None:
        if self.compile_cache is not None and self.compile_cache.strip().lower() == "off":
            return None
        return Path(self.compile_cache or self.home / "compiled").expanduser().resolve()

    @property
    def outbox_folder(self) -> Path:
        return (self.outbox_dir or self.home / "outbox").resolve()

    @property
    def broker_folder(self) -> Path:
        return (self.home / "broker").resolve()

    @property
    def broker(self) -> str:
        return self.broker_url.get_secret_value() if self.broker_url else "filesystem://"

    @property
    def database(self) -> str:
        if self.database_url:
            return self.database_url.get_secret_value()
        return f"sqlite:///{(self.home / 'preheat.db').resolve()}"


def _format_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:  # a rule across settings; its message names them
        return f"invalid setting {message}"
    field = str(first["loc"][0])
    # URLs carry passwords, tokens are secrets: never echo them.
    shown = "" if field.endswith(("_url", "_token", "_key")) else f" (got {first.get('input')!r})"
    return f"invalid setting PREHEAT_{field.upper()}: {message}{shown}"


def load_settings(**overrides) -> Settings:
    """Build settings from the environment, raising ConfigError with one readable line.

    Secrets may also come from files: with PREHEAT_SECRETS_DIR set (a mounted Kubernetes
    Secret, /run/secrets), a file named like the variable in lower case, e.g.
    `preheat_database_url`, holds its value; a variable that is set wins over its file."""
    import os

    secrets_dir = os.environ.get("PREHEAT_SECRETS_DIR")
    if secrets_dir:
        if not Path(secrets_dir).is_dir():
            raise ConfigError(f"invalid setting PREHEAT_SECRETS_DIR: {secrets_dir} is not a directory")
        overrides["_secrets_dir"] = secrets_dir
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


@functools.cache
def get_settings() -> Settings:
    return load_settings()
