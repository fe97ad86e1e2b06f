"""The module graph of elastic_emb: no import cycles, and each layer imports only what it may.

Read from the source with `ast` (every import statement, at module level or
inside a function), so a lazy import counts as much as a top-level one.
The layers are those of docs/architecture.md's module map.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _processes import run_python

PACKAGE = Path(__file__).resolve().parent.parent / "elastic_emb"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {
        _module_name(p): p
        for p in PACKAGE.rglob("*.py")
        if "_proto" not in p.parts  # generated code
    }
    found["elastic_emb._core"] = PACKAGE / "_core.pyi"  # the C++ extension
    return found


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node, except inside `if TYPE_CHECKING:` blocks (imports for type checkers only)."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module `path` imports: elastic_emb modules by full name, others by top name."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules or sub.startswith("elastic_emb._proto") else base)
    return {m if m.startswith("elastic_emb") else m.split(".")[0] for m in found}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {m for m in _imports(path, modules) if m in modules and m != name}
        for name, path in modules.items()
        if path.suffix == ".py"
    } | {"elastic_emb._core": set()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_is_read_from_the_source():
    graph = _graph()
    # Known edges, so that an empty graph cannot pass the other tests.
    assert "elastic_emb.table" in graph["elastic_emb.local"]
    assert "elastic_emb.ps.cluster" in graph["elastic_emb.ps.remote_table"]
    assert "elastic_emb.ps.protocol" in graph["elastic_emb.ps.servicer"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


# Module (or package prefix) -> what it must never import, even lazily.
FORBIDDEN = {
    # The table interface and in-process tables work without TF, Keras and gRPC.
    "elastic_emb.table": {"tensorflow", "keras", "grpc", "elastic_emb.ps"},
    "elastic_emb.local": {"tensorflow", "keras", "grpc", "elastic_emb.ps"},
    "elastic_emb.gpu": {"tensorflow", "keras", "grpc", "elastic_emb.ps"},
    "elastic_emb.checkpoint": {"tensorflow", "keras", "grpc", "elastic_emb._proto"},
    "elastic_emb.rows": {"tensorflow", "keras", "grpc", "elastic_emb.ps"},
    "elastic_emb.admission": {"tensorflow", "keras", "grpc", "numpy", "elastic_emb."},
    "elastic_emb.eviction": {"tensorflow", "keras", "grpc", "numpy", "elastic_emb."},
    "elastic_emb.storage": {"tensorflow", "keras", "grpc", "numpy", "elastic_emb."},
    "elastic_emb.tiered": {"tensorflow", "keras", "grpc", "elastic_emb.ps"},
    # The PS never needs TensorFlow or Keras, nor the layer.
    "elastic_emb.ps": {
        "tensorflow",
        "keras",
        "elastic_emb.layers",
        "elastic_emb.lookup",
        "elastic_emb.callbacks",
    },
    # Only the PS package speaks protobuf (docs/architecture.md).
    "elastic_emb.layers": {"grpc", "elastic_emb._proto", "elastic_emb.ps"},
    "elastic_emb.lookup": {"grpc", "elastic_emb._proto", "elastic_emb.ps"},
    "elastic_emb.loss_scaling": {"grpc", "elastic_emb._proto", "elastic_emb.ps"},
    "elastic_emb.dense_ps": {"grpc", "elastic_emb._proto", "elastic_emb.ps"},
    "elastic_emb.placement": {"grpc", "elastic_emb._proto", "tensorflow"},
    # The library never depends on its examples.
    "elastic_emb.": {"elastic_emb.examples"},
}


@pytest.mark.parametrize("prefix", sorted(FORBIDDEN))
def test_layers_import_only_what_they_may(prefix: str):
    modules = _modules()
    checked = 0
    for name, path in modules.items():
        if path.suffix != ".py" or not (
            name == prefix or name.startswith(prefix.rstrip(".") + ".")
        ):
            continue
        if prefix == "elastic_emb." and (
            name.startswith("elastic_emb.examples") or name in ("elastic_emb", "elastic_emb.cli")
        ):
            continue  # the examples themselves; the CLI runs the demo; the lazy names
        checked += 1
        imported = _imports(path, modules)
        bad = {
            m
            for m in imported
            for f in FORBIDDEN[prefix]
            if m == f or m.startswith(f + ".") or (f.endswith("_proto") and m.startswith(f))
        }
        assert not bad, f"{name} imports {sorted(bad)}"
    assert checked, f"no module matches {prefix}"


def test_protobuf_messages_are_built_only_in_the_ps_package():
    for name, path in _modules().items():
        if name.startswith("elastic_emb.ps") or path.suffix != ".py":
            continue
        assert "ps_pb2" not in path.read_text(), f"{name} uses protobuf messages"


def test_every_table_kind_implements_the_whole_interface():
    import inspect

    from elastic_emb.gpu import GpuTable
    from elastic_emb.local import LocalTable
    from elastic_emb.ps.remote_table import RemoteTable
    from elastic_emb.table import Table

    def raises(member: object) -> bool:
        function = member.fget if isinstance(member, property) else member
        return "raise NotImplementedError" in inspect.getsource(function)  # type: ignore[arg-type]

    interface = [n for n, m in vars(Table).items() if callable(m) or isinstance(m, property)]
    required = [n for n in interface if raises(vars(Table)[n])]
    assert {"pull", "push", "export_state", "load_state", "step_fusion", "__len__"} <= set(required)
    for kind in (LocalTable, GpuTable, RemoteTable):
        assert issubclass(kind, Table)
        missing = [n for n in required if raises(inspect.getattr_static(kind, n))]
        assert not missing, f"{kind.__name__} does not implement {missing}"


def test_the_keras_layer_loads_neither_grpc_nor_the_ps_in_a_fresh_process():
    # Transitively, as a user's process runs it: a model with a layer, compiled.
    code = (
        "import sys, keras, elastic_emb as ee\n"
        "ids = keras.Input((), dtype='int64')\n"
        "keras.Model(ids, ee.Embedding(4, name='t')(ids)).compile('sgd', 'mse')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'grpc_health')\n"
        "    or m.startswith(('elastic_emb.ps', 'elastic_emb._proto'))))\n"
    )
    out = run_python("-c", code)
    assert out.strip().splitlines()[-1] == "[]"
