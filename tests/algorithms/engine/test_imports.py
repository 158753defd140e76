"""The package's import graph: no module imports another's private names (a leading ``_``),
and no module imports one that imports it back (directly or around a longer circle).

Both read the source (AST), function-level imports included: a lazy import still couples the
two modules, and is how a circle hides."""
import ast
from pathlib import Path

import pfl_algorithms

ROOT = Path(pfl_algorithms.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def imports(name: str) -> list[tuple[int, str, str]]:
    """(line, module, imported name) of every ``from X import name`` of module ``name`` whose X
    is in this package (relative imports resolved); ``import X`` gives name ''."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found += [(node.lineno, source, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "") for alias in node.names]
    return [(line, source, imported) for line, source, imported in found
            if source == ROOT.name or source.startswith(ROOT.name + ".")]


def private_uses(name: str) -> list[str]:
    """Where module ``name`` takes a private name from another module of the package: imports it,
    or reads ``module._name`` off a module it imported."""
    uses, module_aliases = [], {}
    for line, source, imported in imports(name):
        if imported and f"{source}.{imported}" in MODULES:
            module_aliases[imported] = f"{source}.{imported}"  # `from . import records`
        elif imported.startswith("_"):
            uses.append(f"{name}:{line} imports {imported} from {source}")
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            uses.append(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}")
    return uses


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a submodule named in ``from P import sub``
    counts as that submodule, not as P)."""
    graph = {}
    for name in MODULES:
        edges = set()
        for _, source, imported in imports(name):
            if imported and f"{source}.{imported}" in MODULES:
                edges.add(f"{source}.{imported}")
            elif source in MODULES:
                edges.add(source)
        edges.discard(name)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each
    sorted: every import circle lies within one."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_another_modules_private_names():
    uses = [use for name in MODULES for use in private_uses(name)]
    assert uses == [], "make these public (and document them) or keep them in their module:\n" + "\n".join(uses)


def test_the_import_graph_has_no_circle():
    assert circles(import_graph()) == []


def test_the_checks_see_what_they_look_for():
    # The checks themselves: they find the imports a circle is made of, lazy ones included.
    graph = import_graph()
    assert "pfl_algorithms.engine.executors" in graph["pfl_algorithms.engine.batched"]
    assert "pfl_algorithms.engine.batched" in graph["pfl_algorithms.engine.executor_factory"]
    assert "pfl_algorithms.runner" in graph["pfl_algorithms.flower.client"]  # imported inside a function
    assert "pfl_algorithms.flower.records" in graph["pfl_algorithms.flower.strategy"]  # `from . import records`
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
