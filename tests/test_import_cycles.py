"""No import cycles among Loom's modules.

The graph is read from the source with `ast`, not from `sys.modules`: every `import` and
`from ... import` anywhere in a file counts (inside functions, under `if TYPE_CHECKING:`),
because a deferred import is a cycle hidden, not removed. Edges:

- `import a.b` -> module `a.b` (its parent packages are not counted);
- `from a import b` -> module `a.b` when that is a module, else `a` (its `__init__`);
- relative imports are resolved against the importing module's package first.

A cycle is a strongly connected component of more than one module, or a module that
imports itself. Package `__init__` modules are ordinary nodes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import loom

LOOM_ROOT = Path(loom.__file__).resolve().parent


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `line` of `source`'s file."""

    source: str
    target: str
    line: int


def module_files(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every .py file under `root`."""
    modules: dict[str, tuple[Path, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def _known_prefix(name: str, modules: dict[str, tuple[Path, bool]]) -> str | None:
    """The longest prefix of dotted `name` that is a known module (None: not ours)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_edges(root: Path, package: str) -> list[Edge]:
    """Every import between modules of `package` (rooted at `root`), in file order."""
    modules = module_files(root, package)
    edges: list[Edge] = []
    for name, (path, is_package) in modules.items():
        # The package a relative import at level 1 names: the module itself for an __init__.
        own_package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = own_package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join([*base_parts, *([node.module] if node.module else [])])
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if alias.name != "*" and sub in modules else base)
            for target in targets:
                resolved = _known_prefix(target, modules)
                if resolved is not None:
                    edges.append(Edge(name, resolved, node.lineno))
    return edges


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module, and self-importing modules,
    each sorted, in sorted order (Tarjan's algorithm, iterative)."""
    graph: dict[str, list[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge.target)
        graph.setdefault(edge.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        # Each frame: (node, iterator position into graph[node]).
        work: list[tuple[str, int]] = [(start, 0)]
        while work:
            node, pos = work.pop()
            if pos == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            successors = graph[node]
            if pos < len(successors):
                work.append((node, pos + 1))
                succ = successors[pos]
                if succ not in index:
                    work.append((succ, 0))
                elif succ in on_stack:
                    low[node] = min(low[node], index[succ])
                continue
            if work:  # propagate to the parent frame's node
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))
    return sorted(components)


def describe(cycle: list[str], edges: list[Edge]) -> str:
    """One cycle and the import lines that close it."""
    members = set(cycle)
    inner = sorted({(e.source, e.line, e.target)
                    for e in edges if e.source in members and e.target in members})
    return " <-> ".join(cycle) + "".join(f"\n    {s}:{n} -> {t}" for s, n, t in inner)


def test_loom_has_no_import_cycles() -> None:
    edges = import_edges(LOOM_ROOT, "loom")
    cycles = find_cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(describe(c, edges) for c in cycles)


def test_walker_sees_deferred_relative_and_type_checking_imports(tmp_path: Path) -> None:
    """The graph builder itself: each kind of import is an edge, and cycles are found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import thing\n",  # pkg -> pkg.a (a name in a module)
        "a.py": "def f():\n    from . import b\n",  # deferred relative: pkg.a -> pkg.b
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        "c.py": "from pkg import sub\nfrom pkg import thing\nimport os\n",  # -> pkg.sub, pkg
        "sub/__init__.py": "from ..c import x\n",  # pkg.sub -> pkg.c
        "d.py": "from .d import y\n",  # self-import
        "e.py": "from pkg.sub import *\n",  # pkg.e -> pkg.sub, one way only
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    edges = import_edges(pkg, "pkg")
    assert {(e.source, e.target) for e in edges} == {
        ("pkg", "pkg.a"), ("pkg.a", "pkg.b"), ("pkg.b", "pkg.a"), ("pkg.c", "pkg.sub"),
        ("pkg.c", "pkg"), ("pkg.sub", "pkg.c"), ("pkg.d", "pkg.d"), ("pkg.e", "pkg.sub"),
    }
    assert find_cycles(edges) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub"], ["pkg.d"]]
