"""The import direction of the design: schedules → tasks → workers → preheat, and no circles.

A file in workers/ must be testable with a model and no broker; a task with a worker and no
scheduler. An import the wrong way, or two modules that need each other, breaks that
quietly, so it fails here. Every import counts, those inside functions too: a lazy import
is still a dependency. The CLI (preheat/cli) is the top floor and the one exemption.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("preheat", "workers", "tasks", "schedules", "migrations")
# package → the packages of this project it may import
ALLOWED = {
    "preheat": {"preheat"},
    "workers": {"workers", "preheat"},
    "tasks": {"tasks", "workers", "preheat"},
    "schedules": {"schedules", "tasks", "workers", "preheat"},
    "migrations": {"migrations", "preheat"},
}
TOP_FLOOR = "preheat.cli"
# workers/ knows nothing of Celery or the database (preheat's settings and errors only).
WORKERS_NEVER = {"celery", "preheat.celery", "preheat.db", "preheat.history", "preheat.outbox", "preheat.dispatch"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


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
    known = modules()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def counts(module: str, target: str | None) -> bool:
        # A module's own packages are imported before it whatever it says (`from preheat.cli
        # import render` inside preheat/cli): that is no dependency of its own.
        return target is not None and not (module == target or module.startswith(target + "."))

    graph = {}
    for module, path in known.items():
        targets = {resolve(name) for name in imported_names(path)}
        graph[module] = {target for target in targets if counts(module, target)}
    return graph


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
                    work.append((child, iter(sorted(graph[child]))))
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
        if module == TOP_FLOOR or module.startswith(TOP_FLOOR + "."):
            continue
        allowed = ALLOWED[module.split(".")[0]]
        found += [f"{module} imports {t}" for t in sorted(targets) if t.split(".")[0] not in allowed]
    return found


def test_the_import_graph_has_no_circle():
    assert circles(project_graph()) == []


def test_imports_point_down_the_layers():
    assert layering_violations(project_graph()) == []


def test_workers_know_nothing_of_celery_or_the_database():
    found = [
        f"{module} imports {name}"
        for module, path in modules().items()
        if module.startswith("workers")
        for name in sorted(imported_names(path))
        if any(name == f or name.startswith(f + ".") for f in WORKERS_NEVER)
    ]
    assert found == []


def test_the_checks_see_a_circle_and_an_upward_import():
    # The detector itself, on a made-up graph: a test that cannot fail proves nothing.
    graph = {"preheat.a": {"preheat.b"}, "preheat.b": {"preheat.c"}, "preheat.c": {"preheat.a"}, "tasks.t": set()}
    assert circles(graph) == [["preheat.a", "preheat.b", "preheat.c"]]
    assert layering_violations({"preheat.a": {"tasks.t"}, "tasks.t": {"preheat.a"}}) == ["preheat.a imports tasks.t"]
    assert layering_violations({"preheat.cli.x": {"schedules.s"}}) == []


def test_tests_mirror_the_packages():
    for package in ("preheat", "tasks", "workers", "schedules"):
        assert (REPO / "tests" / package).is_dir(), package


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
