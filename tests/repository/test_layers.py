"""The package's layers, as docs/architecture.md lists them: each folder
imports only what lies below it."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gpukv"


def gpukv_imports(path: Path) -> set[str]:
    """Every gpukv module the file imports (relative imports resolved), at any depth."""
    parts = ("gpukv",) + path.relative_to(PACKAGE).with_suffix("").parts
    here = parts[:-1]  # the file's package
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "gpukv")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ((node.module,) if node.module else ()))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "gpukv":
                continue
            if node.module is None:  # from . import x: x is a module of that package
                out.update(f"{mod}.{a.name}" for a in node.names)
            else:
                out.add(mod)
    return out


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("core", "kernels", "sim", "vllm"):
        return parts[1]
    if module in ("gpukv.cli",):
        return "cli"
    return "facade"


ALLOWED = {
    "core": {"core"},
    "kernels": {"core", "kernels"},
    "facade": {"core", "kernels", "facade"},
    "sim": {"facade", "sim"},  # the public package and its own modules
    "vllm": {"core", "facade", "vllm"},  # the adapter: the public package, the table layouts it reads
    "cli": {"core", "facade", "sim", "cli"},
}

FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES])
def test_each_module_imports_only_the_layers_below(path):
    module = ".".join(("gpukv",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    layer = layer_of(module)
    wrong = sorted(m for m in gpukv_imports(path) if layer_of(m) not in ALLOWED[layer])
    assert not wrong, f"{module} ({layer}) imports {wrong}"


def test_the_rule_sees_a_violation():
    assert layer_of("gpukv.sim.simulate") == "sim"
    assert "sim" not in ALLOWED["facade"] and "facade" not in ALLOWED["kernels"]
    found = gpukv_imports(PACKAGE / "kernels" / "tree.py")
    assert any(m.startswith("gpukv.core") for m in found)  # relative imports are resolved


def module_name(path: Path) -> str:
    return ".".join(("gpukv",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a package import is its ``__init__``)."""
    modules = {module_name(p): p for p in FILES}
    return {m: {x for x in gpukv_imports(p) if x in modules and x != m} for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == []


def test_the_circle_rule_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The facade's own order, bottom up, as docs/architecture.md lists it: each
# module imports only modules before it (the package's __init__ comes last).
FACADE_ORDER = [
    "table_sizes", "tables", "memory", "streams", "kernel_cache", "launcher", "page_memory", "tokens",
    "tree", "arena", "inputs", "matching", "cache_pool", "page_reads", "cache", "batch",
    "event_types", "events", "stats", "manager", "introspect", "zmq_events", "compile", "",
]


def facade_order_violations(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    rank = {("gpukv." + m) if m else "gpukv": i for i, m in enumerate(order)}
    return sorted(
        f"{m} imports {d}"
        for m in graph if m in rank
        for d in graph[m] if d in rank and rank[d] >= rank[m]
    )


def test_the_facade_imports_in_its_documented_order():
    graph = import_graph()
    facade = {m for m in graph if layer_of(m) == "facade"}
    listed = {("gpukv." + m) if m else "gpukv" for m in FACADE_ORDER}
    assert facade == listed, f"not in FACADE_ORDER: {sorted(facade - listed)}; gone: {sorted(listed - facade)}"
    assert facade_order_violations(graph, FACADE_ORDER) == []
    architecture = PACKAGE.parent / "docs/architecture.md"
    doc = architecture.read_text()
    doc = doc[doc.index("3. The host facade"):doc.index("4. `gpukv/sim/`")]
    at = [doc.index(f"`{m}.py`") for m in FACADE_ORDER if m]
    assert at == sorted(at), "docs/architecture.md lists the facade in another order"


def test_the_order_rule_sees_an_upward_import():
    graph = {"gpukv.tables": {"gpukv.manager"}, "gpukv.manager": {"gpukv.tables"}}
    assert facade_order_violations(graph, ["tables", "manager"]) == ["gpukv.tables imports gpukv.manager"]
