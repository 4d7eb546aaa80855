"""Shared fixtures: a real small model on disk, a real Postgres database, a real Redis db
index, and the two stacks preheat runs on (embedded default, and Redis + Postgres).

Nothing here mocks a service. Each session creates its own Postgres database and uses its
own Redis db index, and removes what it made.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
import redis
from sqlalchemy import text

REPO = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("PREHEAT_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def _redis_url() -> str:
    """Db 11, or 11 + n for pytest-xdist's worker n: parallel sessions never share a db."""
    base = os.environ.get("PREHEAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    if not worker.isdigit() or worker == "0":
        return base
    server, db = base.rsplit("/", 1)
    index = int(db) + int(worker)
    if index > 15:  # never wrap around onto db 0, somebody's data: the tests flush their db
        raise RuntimeError(
            f"pytest-xdist worker gw{worker} would use Redis db {index}; Redis has 0-15: "
            f"run fewer workers or set PREHEAT_TEST_REDIS_URL to a lower db"
        )
    return f"{server}/{index}"


REDIS_URL = _redis_url()
# The console scripts as installed (pyproject's [project.scripts]): what the compose file, the
# manifests and the README run, so a script whose target moved fails here.
PREHEAT_CLI = str(Path(sys.executable).parent / "preheat")
PREHEAT_WORKER_CLI = str(Path(sys.executable).parent / "preheat-worker")

SUPPORT_PROMPT = (
    "You are the support assistant of Acme Parcel. Be concise and polite. Always ask for the tracking "
    "number first. Never promise a delivery date the tracking system does not show. Offer an "
    "investigation when a parcel is more than three working days late."
)


def pytest_addoption(parser):
    parser.addoption("--skip-slow", action="store_true", help="skip end-to-end tests that start processes")


# What a broker or a worker writes where it runs: a test that leaves one in the checkout
# (kombu's filesystem transport defaults to folders under the working directory) fails the run.
RUNTIME_OUTPUT = ("control", "queue", "processed")
_FOUND_BEFORE = pytest.StashKey[set]()


def pytest_sessionstart(session):
    session.config.stash[_FOUND_BEFORE] = {name for name in RUNTIME_OUTPUT if (REPO / name).exists()}


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controlling process looks, once every worker is done
    left = {name for name in RUNTIME_OUTPUT if (REPO / name).exists()} - session.config.stash[_FOUND_BEFORE]
    if left:
        print(f"\ntests left runtime output in the checkout: {', '.join(sorted(left))}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The modules that hold the longest tests (1-4 minutes each on 2 cores: compiling, benches,
# the real model), run first: the test processes take work as they finish (`--dist load`), so
# a long test started last would keep one process busy after the others are done.
LONGEST_FIRST = (
    "tests/workers/engine/test_compiled.py",
    "tests/preheat/test_bench.py",
    "tests/preheat/test_realmodel.py",
    "tests/preheat/test_fleetbench.py",
    "tests/workers/test_real_model.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: else as collected
    if config.getoption("--skip-slow"):
        skip = pytest.mark.skip(reason="--skip-slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


# A real model, built once per session --------------------------------------------------


def run_folder(tmp_path_factory) -> Path:
    """A folder the whole run shares: pytest-xdist's workers' base folders share a parent."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_dev_model(tmp_path_factory, arch: str) -> Path:
    """A small model of `arch`, built once per run for every test process (under a lock,
    renamed into place whole): the same folder, so the same digest, in each, and what one
    process compiled for it another restores (tests/workers/engine/test_compiled.py)."""
    import fcntl
    import tempfile

    from preheat.cli.devmodel import make_model

    models = run_folder(tmp_path_factory) / "dev-models"
    models.mkdir(exist_ok=True)
    folder = models / f"tiny-{arch}"
    with open(models / f".{arch}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.is_dir():
            with tempfile.TemporaryDirectory(dir=models) as work:
                os.replace(make_model(Path(work) / "model", arch=arch), folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return shared_dev_model(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A second architecture (bias on q/k/v, another rope base): reuse must not depend on Llama."""
    return shared_dev_model(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct, converted from its PyPI wheel once per machine (shared by every
    test process through a lock) and proven against its manifest (preheat.cli.realmodel)."""
    from preheat.cli.realmodel import machine_copy

    return machine_copy()


@pytest.fixture(scope="session")
def dev_model(tmp_path_factory):
    """dev_model(arch): a small model of `arch` (preheat.cli.devmodel.ARCHITECTURES), built once a run."""
    return lambda arch: shared_dev_model(tmp_path_factory, arch)


def support_request(resident, user_input: str):
    """(prefix ids, prompt ids) of a request with the `support` system prompt, rendered
    with the model's chat template."""
    from preheat.workers.engine.chat import TemplatePrefix

    prefix = TemplatePrefix.of(resident, SUPPORT_PROMPT)
    return prefix.ids, prefix.prompt_ids(resident, user_input)


def greedy(max_tokens: int, **more):
    from preheat.api.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **more)


def answers_together(scheduler, resident, requests: list) -> list:
    """Each (prompt ids, sampling) of `requests` submitted at once from a thread of its own, so
    their rows run together; the completions in the requests' order."""
    import threading

    results: list = [None] * len(requests)

    def one(i: int) -> None:
        results[i] = scheduler.submit(resident, *requests[i]).collect()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results


def reference_generate(resident, prompt_ids, max_new_tokens: int, **options) -> list[int]:
    """transformers' own generate, from scratch, with no prefix anywhere: the ground truth."""
    import torch

    options = {"do_sample": False, **options}
    with torch.inference_mode():
        out = resident.model.generate(
            input_ids=prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=resident.tokenizer.pad_token_id,
            **options,
        )
    return out[0, prompt_ids.shape[-1] :].tolist()


def new_scheduler(store=None, limits=None, *, max_entries: int = 64, max_bytes: int = 512 * 1024**2):
    """The production scheduler over a prefix cache of its own (and a prefix store, if given)."""
    from preheat.workers.engine.kvcache import CacheBudget, KVCacheManager
    from preheat.workers.engine.prefixes import Prefixes
    from preheat.workers.engine.scheduler import BatchLimits, Scheduler

    prefixes = Prefixes(KVCacheManager(CacheBudget(max_entries=max_entries, max_bytes=max_bytes)), store)
    return Scheduler(prefixes, limits or BatchLimits())


@pytest.fixture
def scheduler():
    """A scheduler for one test, stopped after it."""
    made = new_scheduler()
    yield made
    made.close()


def load_resident(model_dir: Path, name: str = "tiny"):
    from preheat.workers.engine.resident import ModelSource, ResidentModels

    resident, _ = ResidentModels("cpu").ensure(ModelSource(name, str(model_dir)))
    return resident


# Real services ------------------------------------------------------------------------


def _pg_url(database: str) -> str:
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{database}"


@pytest.fixture(scope="session")
def pg_admin():
    try:
        connection = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL} ({exc}); .ci/run starts it")
    yield connection
    connection.close()


@pytest.fixture(scope="session")
def make_pg_database(pg_admin):
    """Create throw-away databases; all are dropped at the end of the session."""
    created: list[str] = []

    def make() -> str:
        name = f"preheat_test_{uuid.uuid4().hex[:10]}"
        pg_admin.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return _pg_url(name)

    yield make
    for name in created:
        pg_admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_migrated(make_pg_database) -> str:
    """One migrated database for the session; tests empty its tables (see `stack`)."""
    from preheat.history import migrate

    url = make_pg_database()
    migrate.upgrade(url)
    return url


@pytest.fixture(scope="session")
def redis_client():
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        pytest.fail(f"Redis is not reachable at {REDIS_URL} ({exc}); .ci/run starts it")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


# Settings applied to this process ---------------------------------------------------


@pytest.fixture
def apply_env(monkeypatch):
    """Set PREHEAT_* for this process (and nothing inherited), with the cached settings and engine reset."""
    from preheat.core.settings import get_settings
    from preheat.history.db import reset_connections

    def apply(env: dict[str, str]) -> None:
        for key in [k for k in os.environ if k.startswith("PREHEAT_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            if key.startswith("PREHEAT_"):
                monkeypatch.setenv(key, value)
        get_settings.cache_clear()
        reset_connections()

    yield apply
    get_settings.cache_clear()
    reset_connections()


def write_catalog(folder: Path, model_dir: Path | str, extra: str = "") -> Path:
    path = folder / "preheat.toml"
    path.write_text(
        f'[models.tiny]\npath = "{model_dir}"\n\n'
        f'[templates.support]\nmodel = "tiny"\nsystem_prompt = "{SUPPORT_PROMPT}"\nprobe = "Where is my parcel?"\n'
        f"{extra}"
    )
    return path


# The two stacks ----------------------------------------------------------------------


@dataclass
class Stack:
    kind: str  # embedded | services
    home: Path
    catalog: Path
    env: dict[str, str] = field(default_factory=dict)

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return self.cli_env(self.env, *args, timeout=timeout)

    def cli_env(self, env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """`preheat ARGS` in a process of its own with `env` (the stack's, changed)."""
        return subprocess.run(
            [PREHEAT_CLI, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=self.home
        )

    def cli_here(self, *args: str) -> subprocess.CompletedProcess:
        """The same `preheat` entry point, run in this process (the stack's settings are this
        process's): for tables of bad input, where a process start per row is most of the time."""
        return run_cli_here(*args)


def run_cli_here(*args: str) -> subprocess.CompletedProcess:
    import contextlib
    import io

    from preheat.cli import main

    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = ["preheat", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["preheat", *args], code, out.getvalue(), err.getvalue())


def _base_env(home: Path, catalog: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREHEAT_")}
    env.update(
        PREHEAT_HOME=str(home),
        PREHEAT_CATALOG=str(catalog),
        PREHEAT_PROBE_REPEATS="2",
        PREHEAT_HEALTH_PORT="0",
        # Answers compared token for token with transformers in float32, and no compile in
        # a test that does not test it (tests/workers/engine/test_compiled.py does).
        PREHEAT_DTYPE="float32",
        PREHEAT_COMPILE="off",
        # The verdict's timing check is unit-tested with exact numbers; end to end, three
        # test processes and their workers share two cores, and a probe slowed 12x by a
        # neighbour was seen. The other two checks of `warm` (the cached prefix was used,
        # and gave full prefill's token) stay exact.
        PREHEAT_WARM_FACTOR="100",
        # Heartbeats fast enough that a test sees a worker die within seconds.
        PREHEAT_HEARTBEAT_INTERVAL_S="1",
        PREHEAT_WORKER_DEAD_AFTER_S="5",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
    )
    return env


def _empty_tables(url: str) -> None:
    """The process's database emptied for the next test. TRUNCATE waits on the locks of anything
    an earlier test left connected (a full run's setup once waited 300 s, twice): that is ended
    first, and a lock still held fails in 30 s naming the wait."""
    import gc

    from preheat.history.db import open_database

    gc.collect()  # a session a test left in a reference cycle gives its connection back
    engine = open_database(url)
    with engine.begin() as connection:
        connection.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )
        connection.execute(text("SET LOCAL lock_timeout = '30s'"))
        connection.execute(
            text(
                "TRUNCATE warmup_jobs, warmup_runs, schedule_slots, schedules, beat_leases, traffic_counts, "
                "workers, endpoint_keepalives, applied_writes"
            )
        )
    engine.dispose()


def _make_stack(kind: str, request, tmp_path: Path, model_dir: Path, apply_env) -> Stack:
    from preheat.core.settings import get_settings
    from preheat.history import migrate

    home = tmp_path / "home"
    home.mkdir()
    catalog = write_catalog(tmp_path, model_dir)
    env = _base_env(home, catalog)
    if kind == "services":
        redis_client = request.getfixturevalue("redis_client")
        database_url = request.getfixturevalue("pg_migrated")
        redis_client.flushdb()
        _empty_tables(database_url)
        env.update(PREHEAT_BROKER_URL=REDIS_URL, PREHEAT_DATABASE_URL=database_url)
    apply_env(env)
    if kind == "embedded":
        migrate.upgrade(get_settings().database)
    return Stack(kind, home, catalog, env)


@pytest.fixture(params=["embedded", "services"])
def stack(request, tmp_path, tiny_model, apply_env) -> Stack:
    """The embedded default (filesystem broker, SQLite) and the real services (Redis, Postgres)."""
    return _make_stack(request.param, request, tmp_path, tiny_model, apply_env)


@pytest.fixture
def stack_app(stack):
    """This process's Celery app, pointed at the stack's broker: for code that sends tasks
    in-process (beat's dispatch, the watchers), as their own processes would."""
    from preheat.celery.app import app, celery_config
    from preheat.core.settings import get_settings

    _point_app(app, celery_config(get_settings()))
    yield app
    _point_app(app, None)


@pytest.fixture
def embedded_app(embedded_stack):
    """This process's Celery app on the embedded stack (as stack_app is on either)."""
    yield from _app_of_this_process()


@pytest.fixture
def services_app(services_stack):
    """This process's Celery app on Redis + Postgres (as stack_app is on either)."""
    yield from _app_of_this_process()


def _app_of_this_process():
    from preheat.celery.app import app, celery_config
    from preheat.core.settings import get_settings

    _point_app(app, celery_config(get_settings()))
    yield app
    _point_app(app, None)


def _point_app(app, config: dict | None) -> None:
    """The process's one app pointed at this test's stack: its broker pool, its result backend
    (Celery keeps the backend it made first) and the router that sends with it
    (preheat.fleet.routing keeps one per app, holding the settings it was made with)."""
    from preheat.fleet import routing

    # Kombu keeps one pool per broker URL for the process (not closed here: it is shared).
    app._pool = None
    app.amqp._producer_pool = None
    app._backend_cache = None
    app._local.__dict__.pop("backend", None)
    routing._ROUTERS.pop(id(app), None)
    if config is not None:
        app.conf.update(config)


@pytest.fixture
def embedded_stack(request, tmp_path, tiny_model, apply_env) -> Stack:
    """The embedded default alone, for what does not depend on the services."""
    return _make_stack("embedded", request, tmp_path, tiny_model, apply_env)


@pytest.fixture
def services_stack(request, tmp_path, tiny_model, apply_env) -> Stack:
    """Redis + Postgres alone, for what reads the services directly."""
    return _make_stack("services", request, tmp_path, tiny_model, apply_env)
