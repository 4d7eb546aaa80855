"""The import direction of the design: schedules → tasks → workers → preheat.

A file in workers/ must be testable with a model and no broker; a task with a worker and no
scheduler. An import the wrong way breaks that quietly, so it fails here.
"""

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

# package → packages of this project it must never import
FORBIDDEN = {
    "workers": {"tasks", "schedules", "celery", "preheat.celery", "preheat.db", "preheat.history"},
    "tasks": {"schedules"},
    "migrations": {"tasks", "workers", "schedules"},
}
# preheat is the core: only its CLI and dev tooling reach up into tasks and workers.
PREHEAT_ENTRY_POINTS = {"preheat/cli"}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def violations(package: str, forbidden: set[str]) -> list[str]:
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(REPO)} imports {name}")
    return found


@pytest.mark.parametrize(("package", "forbidden"), sorted(FORBIDDEN.items()))
def test_packages_import_only_downwards(package, forbidden):
    assert violations(package, forbidden) == []


def test_the_core_does_not_import_the_layers_above_it():
    found = []
    for path in sorted((REPO / "preheat").rglob("*.py")):
        if any(str(path.relative_to(REPO)).startswith(entry) for entry in PREHEAT_ENTRY_POINTS):
            continue
        for name in imports_of(path):
            if name.split(".")[0] in {"tasks", "workers", "schedules", "migrations"}:
                found.append(f"{path.relative_to(REPO)} imports {name}")
    assert found == []


def test_tests_mirror_the_packages():
    for package in ("preheat", "tasks", "workers", "schedules"):
        assert (REPO / "tests" / package).is_dir(), package
