"""The folders are the floors, and imports point only down them; no circles; no exemption.

From the ground up: the core every process shares (settings, catalog, errors, states); the
OpenAI protocol (`preheat/api`); the engine (`workers/engine`), which knows nothing of the
worker around it; the worker runtime (`workers/`); the history (`preheat/history`) and the
Alembic migrations; the Celery integration (`preheat/celery`); remote endpoints
(`preheat/endpoints`); the fleet's control plane (`preheat/fleet`); the tasks (`tasks/`);
what starts them (`schedules/`); the CLI on top. A file may import its own folder and the
floors its folder is given here, nothing else: an import the wrong way, or two modules that
need each other, breaks a floor's promise quietly (the engine testable with a model and no
worker; a worker runtime with no broker; a task with a worker and no scheduler), so it
fails here. Every import counts, those inside functions too: a lazy import is still a
dependency.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from tests.conftest import REPO

# Where each importable name lives in the repository: the installed distribution has one
# top-level name, preheat; the repository keeps tasks/, workers/, ... beside preheat/
# (pyproject.toml's package-dir).
FOLDERS = {
    "preheat": "preheat",
    "preheat.workers": "workers",
    "preheat.tasks": "tasks",
    "preheat.schedules": "schedules",
    "preheat.migrations": "migrations",
}
CORE, API, ENGINE, WORKERS = "preheat.core", "preheat.api", "preheat.workers.engine", "preheat.workers"
HISTORY, MIGRATIONS, CELERY = "preheat.history", "preheat.migrations", "preheat.celery"
ENDPOINTS, FLEET, TASKS, SCHEDULES, CLI = (
    "preheat.endpoints",
    "preheat.fleet",
    "preheat.tasks",
    "preheat.schedules",
    "preheat.cli",
)
# floor -> the floors below it that it may import (its own folder always)
FLOORS = {
    CORE: set(),
    API: {CORE},
    ENGINE: {CORE, API},
    WORKERS: {CORE, API, ENGINE},
    HISTORY: {CORE},
    MIGRATIONS: {CORE, HISTORY},
    CELERY: {CORE, HISTORY},
    ENDPOINTS: {CORE, API},
    FLEET: {CORE, API, HISTORY, CELERY, ENDPOINTS},
    TASKS: {CORE, API, ENGINE, WORKERS, HISTORY, CELERY, ENDPOINTS, FLEET},
    SCHEDULES: {CORE, API, HISTORY, CELERY, ENDPOINTS, FLEET, TASKS},
    CLI: {CORE, API, ENGINE, WORKERS, HISTORY, MIGRATIONS, CELERY, ENDPOINTS, FLEET, TASKS, SCHEDULES},
}
# The package itself: preheat/__init__.py hands `celery -A preheat` the app, lazily.
ENTRY_POINTS = {"preheat": {CELERY}}
MAX_LINES = 500


def module_files() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            name = ".".join([package, *parts])
            if package == "preheat" and len(parts) and parts[0] in ("workers", "tasks", "schedules", "migrations"):
                raise AssertionError(f"{path} shadows the {parts[0]}/ folder")
            found[name] = path
    return found


def floor_of(module: str) -> str:
    """The floor a module stands on: the longest floor name that is its prefix."""
    floors = [f for f in [*FLOORS, *ENTRY_POINTS] if module == f or module.startswith(f + ".")]
    return max(floors, key=len) if floors else module


def imported_names(path: Path) -> set[str]:
    """Every absolute import in the file, as dotted names (`from a import b` gives a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def project_graph() -> dict[str, set[str]]:
    """module → the project modules it imports (a name resolves to its longest module prefix)."""
    known = module_files()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def counts(module: str, target: str | None) -> bool:
        # A module's own packages are imported before it whatever it says: no dependency of its own.
        return target is not None and not (module == target or module.startswith(target + "."))

    return {
        module: {t for t in {resolve(name) for name in imported_names(path)} if counts(module, t)}
        for module, path in known.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        floor = floor_of(module)
        allowed = FLOORS.get(floor, ENTRY_POINTS.get(floor))
        if allowed is None:
            found.append(f"{module} stands on no floor")
            continue
        found += [f"{module} imports {t}" for t in sorted(targets) if floor_of(t) not in allowed | {floor}]
    return found


def test_the_import_graph_has_no_circle():
    assert circles(project_graph()) == []


def test_imports_point_down_the_floors_without_exemption():
    assert layering_violations(project_graph()) == []


def test_every_module_stands_on_a_floor_and_the_package_root_holds_only_entry_points():
    modules = module_files()
    assert [m for m in modules if floor_of(m) not in FLOORS and m not in ENTRY_POINTS] == []
    assert sorted(path.name for path in (REPO / "preheat").glob("*.py")) == ["__init__.py"]


def test_the_engine_and_the_worker_know_nothing_of_celery_or_the_database():
    """The engine runs with a model and nothing else; the worker runtime with no broker
    (tasks/ wraps it in Celery) and no database (its history goes through tasks/)."""
    never = {ENGINE: ("celery", "kombu", "sqlalchemy", "tornado", "httpx"), WORKERS: ("celery", "kombu", "sqlalchemy")}
    found = [
        f"{module} imports {name}"
        for module, path in module_files().items()
        if floor_of(module) in never
        for name in sorted(imported_names(path))
        if any(name == o or name.startswith(o + ".") for o in never[floor_of(module)])
    ]
    assert found == []


def test_the_checks_see_a_circle_and_an_upward_import():
    # The detector itself, on a made-up graph: a test that cannot fail proves nothing.
    graph = {"preheat.core.a": {"preheat.core.b"}, "preheat.core.b": {"preheat.core.a"}, "preheat.tasks.t": set()}
    assert circles(graph) == [["preheat.core.a", "preheat.core.b"]]
    assert layering_violations({"preheat.core.a": {"preheat.tasks.t"}, "preheat.tasks.t": set()}) == [
        "preheat.core.a imports preheat.tasks.t"
    ]
    assert layering_violations({"preheat.workers.engine.x": {"preheat.workers.runtime"}}) == [
        "preheat.workers.engine.x imports preheat.workers.runtime"
    ]
    assert layering_violations({"preheat.cli.x": {"preheat.schedules.s"}}) == []


def test_no_product_file_is_over_500_lines():
    long = {
        str(p.relative_to(REPO)): n for p in module_files().values() if (n := len(p.read_text().splitlines())) > 500
    }
    assert long == {}


def test_the_distribution_installs_one_top_level_name_and_every_package():
    """tasks/, workers/, ... are installed as preheat.tasks, preheat.workers: a `tasks` module of
    another distribution never collides with ours. Every folder with an __init__.py is listed."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    packages = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert listed == packages
    assert {name.split(".")[0] for name in listed} == {"preheat"}
    assert setuptools["package-dir"] == {name: folder for name, folder in FOLDERS.items() if name != "preheat"}


def test_tests_mirror_the_floors():
    for folder in ("preheat", "tasks", "workers", "schedules"):
        assert (REPO / "tests" / folder).is_dir(), folder


def test_the_readme_is_a_users_page_and_markdown_lines_fit():
    # The README is what a user reads first (about 200 lines at most); the rest is in docs/.
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
    long_lines = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted(REPO.glob("*.md")) + sorted((REPO / "docs").glob("*.md"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if len(line) > 160
    ]
    assert long_lines == []
