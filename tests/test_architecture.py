"""The layout holds: every import in offload/ points down the layers docs/architecture.md
draws (no upward or sideways arrow), no module imports itself through others (no import
circle, however deferred: imports inside functions and under TYPE_CHECKING count), and the
torch-free packages import neither torch nor, below the solver, PuLP.

The allowed arrows are read from docs/architecture.md, so the picture and the rule are one."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

from offload.step import names
from tests.runs import ROOT

TORCH_FREE = ("offload.io", "offload.step", "offload.solver", "offload.analysis")
NO_PULP = ("offload.io", "offload.step")


def allowed_arrows(doc: str) -> dict[str, set[str]]:
    """``package -> the packages it may import``, from the ``layers`` block of the doc: one line
    per package, ``offload.step -> offload.io, offload.errors``."""
    block = re.search(r"```text layers\n(.*?)```", doc, re.S)
    assert block, "docs/architecture.md has no ```text layers block"
    arrows = {}
    for line in block.group(1).strip().splitlines():
        src, _, dst = line.partition("->")
        arrows[src.strip()] = {d.strip() for d in dst.split(",") if d.strip()}
    return arrows


def module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The offload modules ``path`` imports, anywhere in it; ``from P import x`` is module ``P.x``
    when there is one, else ``P``."""
    name = module_of(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return out


def import_graph(root: Path) -> nx.DiGraph:
    files = sorted((root / "offload").rglob("*.py"))
    modules = {module_of(p, root) for p in files}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for p in files:
        for target in imports(p, root, modules):
            g.add_edge(module_of(p, root), target)
    return g


def package(module: str, arrows: dict[str, set[str]]) -> str:
    """The layer a module belongs to: the longest name in ``arrows`` it falls under."""
    return max((p for p in arrows if module == p or module.startswith(p + ".")), key=len, default=module)


def violations(g: nx.DiGraph, arrows: dict[str, set[str]]) -> list[str]:
    out = []
    for cycle in nx.simple_cycles(g):
        out.append("import circle: " + " -> ".join(cycle + cycle[:1]))
    for a, b in g.edges:
        if not b.startswith("offload"):
            continue
        pa, pb = package(a, arrows), package(b, arrows)
        if pa not in arrows:
            out.append(f"{a}: its package is not in docs/architecture.md")
        elif pa != pb and pb not in arrows[pa]:
            out.append(f"arrow against the layers: {a} imports {b} ({pa} may import {sorted(arrows[pa]) or 'nothing'})")
    return out


@pytest.fixture(scope="module")
def arrows():
    return allowed_arrows((ROOT / "docs" / "architecture.md").read_text())


def test_imports_follow_the_layers_and_close_no_circle(arrows):
    g = import_graph(ROOT)
    assert violations(g, arrows) == []
    packages = {package(m, arrows) for m in g.nodes if m.startswith("offload")}
    assert packages == set(arrows), "docs/architecture.md draws the packages there are, no more"


def test_torch_free_packages_import_no_torch(arrows):
    g = import_graph(ROOT)
    for m in g.nodes:
        found = {t.partition(".")[0] for t in g.successors(m)} & {"torch", "pulp"}
        if m.startswith(TORCH_FREE):
            assert "torch" not in found, m
        if m.startswith(NO_PULP):
            assert "pulp" not in found, m


def test_the_check_finds_a_circle_and_an_arrow_upward(arrows, tmp_path):
    """The checks above can fail: a deferred import closing a circle, and the solver reaching
    up into the executor, are both reported."""
    for pkg in ("offload/step", "offload/solver", "offload/executor"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "offload" / "__init__.py").write_text("")
    (tmp_path / "offload/step/a.py").write_text("from .b import x\n")
    (tmp_path / "offload/step/b.py").write_text("def f():\n    from offload.step.a import y\n")
    (tmp_path / "offload/solver/c.py").write_text("from offload.executor import plan\n")
    (tmp_path / "offload/executor/plan.py").write_text("")
    found = violations(import_graph(tmp_path), arrows)
    assert any("circle" in v and "offload.step.a" in v and "offload.step.b" in v for v in found), found
    assert any("offload.solver.c imports offload.executor.plan" in v for v in found), found


def test_a_name_listed_on_one_side_only_is_refused():
    assert names.table(("a", "b"), {"b": 2, "a": 1}, "things") == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match=r"\['c'\] on one side only"):
        names.table(("a", "b"), {"a": 1, "b": 2, "c": 3}, "things")
