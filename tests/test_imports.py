"""hpmoe's modules import one another without a circle: every import counts, also one
inside a function and a package's ``__init__`` that importing a submodule runs; only
imports under ``if TYPE_CHECKING:`` are left out.  Its packages (``exec``, ``runtime``,
``sim``, ...; a top-level module is one of its own) stand in floors: no import runs back
up from a package to one that imports it, the type-only ones included.  And
``import hpmoe`` loads no runtime."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hpmoe"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The hpmoe modules ``node`` (in ``module``) imports, each with its parent packages."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        package = module if modules[module].name == "__init__.py" else module.rsplit(".", 1)[0]
        base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
        stem = ".".join(base + ([node.module] if node.module else []))
        names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
    out = set()
    for name in names:
        while name and name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        parts = name.split(".")
        out |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & modules.keys()
    out.discard(module)
    return sorted(t for t in out if not module.startswith(t + "."))  # a module's own packages run first


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """Module -> the hpmoe modules it imports (``typing``: type-only imports too)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and (typing or id(node) not in typing_only):
                graph[module] |= set(_targets(module, node, modules))
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same imports between packages (``hpmoe.exec``, ...; a top-level module is its own)."""
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = package(module)
        out.setdefault(mine, set()).update(package(t) for t in targets if package(t) != mine)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_finder_sees_a_circle_through_a_function_level_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_hpmoe_has_no_import_circle() -> None:
    graph = import_graph()
    assert "hpmoe.gpu.backend" in graph["hpmoe.engine.paths"]  # an import inside a function counts
    assert circles(graph) == []


def test_no_import_runs_back_up_between_packages() -> None:
    """Packages stand in floors: a circle of packages (exec importing runtime, which
    imports exec, say), counting type-only and in-function imports, names where one
    runs back up."""
    assert circles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    packages = package_graph(import_graph(typing=True))
    assert "hpmoe.runtime" in packages["hpmoe.engine"] and "hpmoe.comm" in packages["hpmoe.exec"]
    assert circles(packages) == []


def test_import_hpmoe_loads_no_runtime() -> None:
    probe = "import sys, hpmoe; print(sorted(m for m in sys.modules if m.startswith('hpmoe.runtime')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
