"""Import boundaries: each service is its own process, with its own code and config.

The import graph of ``services.*`` is read from the AST of every module (every
``import`` and ``from ... import``, inside functions too). No module of a service
package may reach another service package, directly or through shared modules; the
config schemas and the shared plumbing (wire, object store, weights) reach no service
package at all. The composition tools (launcher, bench, cli) may import anything, and
nothing may import them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

from tests.conftest import REPO

SERVICE_PACKAGES = (
    "services.reconciler",
    "services.envs",
    "services.inference",
    "services.trainer",
    "services.evals",
)
SERVICE_FREE_PACKAGES = (
    "services.config",
    "services.wire",
    "services.objectstore",
    "services.weights",
)
COMPOSITION_TOOLS = ("services.launcher", "services.bench", "services.cli")

ImportGraph = Mapping[str, frozenset[str]]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _package_of(module: str, packages: Iterable[str]) -> str | None:
    return next((package for package in packages if _within(module, package)), None)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The ``services.*`` modules `module` imports: for ``from a import b``, ``a.b`` when
    that is a module, and ``a``; with each one the packages above it, which run first."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    parents = {
        ".".join(name.split(".")[:end]) for name in found for end in range(1, name.count(".") + 1)
    }
    return {name for name in found | parents if name in known and name != module}


def import_graph(root: Path = REPO) -> dict[str, frozenset[str]]:
    """Each module under services/ and the ``services.*`` modules it imports."""
    paths = {
        _module_name(path, root): path
        for path in sorted((root / "services").rglob("*.py"))
        if "api/v1" not in path.relative_to(root).as_posix()
    }
    known = set(paths)
    graph: dict[str, frozenset[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = frozenset(_imported(tree, module, path.name == "__init__.py", known))
    return graph


def _reached(graph: ImportGraph, start: str) -> dict[str, list[str]]:
    """Every module `start` reaches, with one import chain to it."""
    chains = {start: [start]}
    stack = [start]
    while stack:
        module = stack.pop()
        for target in graph.get(module, ()):
            if target not in chains:
                chains[target] = [*chains[module], target]
                stack.append(target)
    return chains


def boundary_violations(graph: ImportGraph) -> list[str]:
    """Each import chain that crosses a boundary, as ``a -> b -> c``."""
    problems: list[str] = []
    for module in sorted(graph):
        own = _package_of(module, SERVICE_PACKAGES)
        free = _package_of(module, SERVICE_FREE_PACKAGES)
        for target, chain in sorted(_reached(graph, module).items()):
            tool = _package_of(target, COMPOSITION_TOOLS)
            if tool is not None and _package_of(module, COMPOSITION_TOOLS) is None:
                if target in graph[module]:
                    problems.append(f"{module} -> {target}: only a composition tool imports {tool}")
                continue
            reached = _package_of(target, SERVICE_PACKAGES)
            if reached is None or _package_of(module, COMPOSITION_TOOLS) is not None:
                continue
            if (own is not None and reached != own) or free is not None:
                problems.append(" -> ".join(chain))
    return problems


def test_no_service_reaches_another_and_shared_code_reaches_none() -> None:
    graph = import_graph()
    assert "services.config.trainer" in graph and "services.reconciler_client" in graph
    problems = boundary_violations(graph)
    assert not problems, "import boundaries crossed:\n" + "\n".join(problems)


def test_the_checker_finds_direct_transitive_and_tool_imports() -> None:
    graph: dict[str, frozenset[str]] = {
        "services.evals.metrics": frozenset({"services.telemetry"}),
        "services.telemetry": frozenset({"services.envs.rewards"}),
        "services.envs.rewards": frozenset(),
        "services.envs.worker": frozenset({"services.envs.rewards", "services.launcher.run"}),
        "services.launcher.run": frozenset({"services.trainer.job"}),
        "services.trainer.job": frozenset(),
        "services.wire.client": frozenset({"services.config.deployment"}),
        "services.config.deployment": frozenset({"services.trainer.job"}),
    }
    problems = boundary_violations(graph)
    assert "services.evals.metrics -> services.telemetry -> services.envs.rewards" in problems
    assert any(p.startswith("services.envs.worker -> services.launcher.run:") for p in problems)
    assert "services.wire.client -> services.config.deployment -> services.trainer.job" in problems
    assert "services.config.deployment -> services.trainer.job" in problems
    # Within one service, and from a composition tool, anything goes.
    assert not any(
        p.startswith(("services.envs.worker -> services.envs", "services.launcher"))
        for p in problems
    )


def test_imports_inside_functions_and_relative_imports_count(tmp_path: Path) -> None:
    package = tmp_path / "services"
    (package / "evals").mkdir(parents=True)
    (package / "envs").mkdir()
    for path in ("__init__.py", "evals/__init__.py", "envs/__init__.py", "envs/rewards.py"):
        (package / path).write_text("")
    (package / "evals" / "late.py").write_text(
        "def score():\n    from services.envs import rewards\n    return rewards\n"
    )
    (package / "evals" / "near.py").write_text("from . import late\n")
    graph = import_graph(tmp_path)
    assert graph["services.evals.late"] == {"services", "services.envs", "services.envs.rewards"}
    assert graph["services.evals.near"] == {"services", "services.evals", "services.evals.late"}
    assert "services.evals.late -> services.envs" in boundary_violations(graph)
