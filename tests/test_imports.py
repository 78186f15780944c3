"""The package's module import graph has no cycle.

Every module of leafpy is read with ``ast`` (not imported): each ``import`` and ``from ... import`` statement, at
module level or inside a function or class, relative ones resolved, becomes an edge to the leafpy module it loads.
``from pkg import name`` is an edge to the submodule ``pkg.name`` when there is one, else to the package ``pkg``
(whose ``__init__`` runs). Imports under ``if TYPE_CHECKING:`` never run and are left out (but for the webgpu
backend's layering, which counts them), and so are the parent
packages Python imports before a submodule (leafpy/__init__ re-exports everything, so with them every module
would sit on a cycle). Modules that ``importlib`` loads by name (the layer and update-rule registries) are not
seen. A cycle is reported as the chain of modules that closes it; ``python tests/test_imports.py`` prints the
graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "leafpy"  # this checkout's package, however it is run


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the tree, except (unless ``type_checking``) those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path = PACKAGE, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its code; with ``type_checking``, under
    ``if TYPE_CHECKING:`` too)."""
    mods = modules(root)
    top = root.name
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]  # the package relative imports start in
        for node in _imports(ast.parse(path.read_text(), str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = here[:len(here) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
            for target in targets:
                # `import leafpy.a.b` loads leafpy.a.b; keep the longest prefix that is one of our modules
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target.split(".")[0] == top and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules whose last imports the first, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "leafpy.serialization" in graph and "leafpy.layers.layer" in graph
    assert "leafpy.errors" in graph["leafpy.serialization"]  # a module-level relative import
    assert "leafpy.layers.layer" in graph["leafpy.layers.container.sequential"]


def test_function_level_and_relative_imports_are_edges(tmp_path: Path) -> None:
    pkg = tmp_path / "demo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from .b import g\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import c\n"
                                      "def g():\n    from ..a import f\n")
    (pkg / "c.py").write_text("import demo.a\n")
    graph = import_graph(pkg)
    assert graph["demo.a"] == {"demo.sub.b"}
    assert graph["demo.sub"] == {"demo.sub.b"}
    assert graph["demo.sub.b"] == {"demo.a"}
    assert graph["demo.c"] == {"demo.a"}
    assert find_cycle(graph) == ["demo.a", "demo.sub.b"]


def test_no_import_cycle() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle + cycle[:1])


BELOW_THE_LAYERS = ("leafpy.layer_config", "leafpy.serialization", "leafpy.backends", "leafpy.sources",
                    "leafpy.tensor", "leafpy.errors", "leafpy._checks")
"""What layers are built on: the configs and their codec, the backends, the data sources, tensors, errors."""


def test_nothing_below_the_layers_imports_them() -> None:
    graph = import_graph()
    below = [m for m in graph if any(m == b or m.startswith(b + ".") for b in BELOW_THE_LAYERS)]
    assert "leafpy.serialization.codec" in below and "leafpy.layer_config" in below
    upward = {m: sorted(t for t in graph[m] if t == "leafpy.layers" or t.startswith("leafpy.layers."))
              for m in below}
    assert not {m: t for m, t in upward.items() if t}, upward



WEBGPU = "leafpy.backends.webgpu"
WEBGPU_LAYERS = ("view", "params", "sources", "device", "encoder", "allocator", "binding", "reduce", "gemm",
                 "elementwise", "conv", "half", "")
"""The webgpu backend's modules, lowest first ("" the package, WebGPUBackend): each imports only modules before it —
the array type and the WGSL side (parameter structs, sources), the device part, the encoder, the allocator, then
the kernel families, each using those below it (conv uses gemm and elementwise), float16 as a layer over them all,
and the backend that composes the parts."""


def test_the_webgpu_backend_is_layered_without_cycles() -> None:
    graph = import_graph(type_checking=True)
    package = {m for m in graph if m == WEBGPU or m.startswith(WEBGPU + ".")}
    assert package == {f"{WEBGPU}.{m}" if m else WEBGPU for m in WEBGPU_LAYERS}, "a module missing from the list"
    inside = {m: {t for t in graph[m] if t in package} for m in package}
    cycle = find_cycle(inside)
    assert cycle is None, "webgpu import cycle: " + " -> ".join(cycle + cycle[:1])
    rank = {f"{WEBGPU}.{m}" if m else WEBGPU: i for i, m in enumerate(WEBGPU_LAYERS)}
    upward = {m: sorted(t for t in inside[m] if rank[t] > rank[m]) for m in package}
    assert not {m: t for m, t in upward.items() if t}, upward
    assert f"{WEBGPU}.view" in inside[f"{WEBGPU}.encoder"] and f"{WEBGPU}.gemm" in inside[f"{WEBGPU}.conv"]


def test_no_webgpu_class_sits_on_a_chain_of_leafpy_classes() -> None:
    """The backend is composed, not inherited: a class of the package has at most 2 leafpy classes above it."""
    import importlib
    import inspect

    deep = {}
    for name in WEBGPU_LAYERS:
        module = importlib.import_module(f"{WEBGPU}.{name}" if name else WEBGPU)
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                above = [c.__qualname__ for c in cls.__mro__[1:] if c.__module__.startswith("leafpy.")]
                if len(above) > 2:
                    deep[cls.__qualname__] = above
    assert not deep, deep


if __name__ == "__main__":  # print the graph as an adjacency list
    for module, targets in sorted(import_graph().items()):
        print(module, "->", ", ".join(sorted(t.removeprefix("leafpy.") for t in targets)) or "(none)")
