"""The import graph of the packages has floors and no circles (docs/architecture.md,
"Layers"): ``kernels`` imports nothing of ours, ``shared`` only ``shared`` (and
``kernels``), ``gateway`` and ``worker`` never each other, and no set of modules imports
itself round. Every import counts, those inside functions too; the graph is read from
the source with ``ast``, nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "shared", "gateway", "worker")
#: What each package may import of ours.
ALLOWED = {"kernels": {"kernels"}, "shared": {"shared", "kernels"}, "gateway": {"gateway", "shared", "kernels"},
           "worker": {"worker", "shared", "kernels"}}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``from a.b import c`` counts ``a.b.c``
    when that is a module, else ``a.b``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
                    break
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root, targets in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(targets)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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


def test_no_import_circles() -> None:
    assert circles(import_graph()) == []


def test_no_arrow_runs_up_or_across() -> None:
    wrong = [f"{a} -> {b}" for a, targets in import_graph().items() for b in sorted(targets)
             if b.partition(".")[0] not in ALLOWED[a.partition(".")[0]]]
    assert wrong == []


def test_the_checks_see_a_circle_and_an_upward_arrow() -> None:
    """The graph reader finds what it must: a made-up circle, and imports inside functions."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "gateway.app" in graph["gateway.cli"]  # imported inside serve()
    assert "worker.engine.step_types" in graph["worker.engine.scheduler"]
