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
    assert "elastic_emb.tables.table" in graph["elastic_emb.tables.local"]
    assert "elastic_emb.ps.client.cluster" in graph["elastic_emb.ps.client.remote_table"]
    assert "elastic_emb.ps.wire.protocol" in graph["elastic_emb.ps.server.servicer"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


# Package -> the packages its modules may import (its own included), lowest first.
# A module belongs to the longest package prefix listed; docs/architecture.md
# draws the same map.
# The base: warnings, the C++ core, the supported Keras range (Keras imported only if asked).
BASE = {"elastic_emb.errors", "elastic_emb._core", "elastic_emb.keras_range"}
TABLES = {"elastic_emb.tables", *BASE}
ALLOWED = {
    "elastic_emb.errors": set(),
    "elastic_emb.keras_range": set(),
    "elastic_emb.ps": set(),  # its __init__: the sub-packages below
    "elastic_emb.tables": TABLES,
    "elastic_emb.tables.policies": {"elastic_emb.tables.policies", *BASE},
    "elastic_emb.persistence": {"elastic_emb.persistence", *TABLES},
    "elastic_emb.serving": {"elastic_emb.serving", "elastic_emb.persistence", *TABLES},
    "elastic_emb.ps.wire": {"elastic_emb.ps.wire", "elastic_emb._proto", *TABLES},
    "elastic_emb.ps.coord": {
        "elastic_emb.ps.coord",
        "elastic_emb.ps.wire",
        "elastic_emb._proto",
        *TABLES,
    },
    "elastic_emb.ps.server": {
        "elastic_emb.ps.server",
        "elastic_emb.ps.coord",
        "elastic_emb.ps.wire",
        "elastic_emb._proto",
        "elastic_emb.persistence",
        *TABLES,
    },
    "elastic_emb.ps.client": {
        "elastic_emb.ps.client",
        "elastic_emb.ps.coord",
        "elastic_emb.ps.wire",
        "elastic_emb._proto",
        "elastic_emb.persistence",
        *TABLES,
    },
    "elastic_emb.keras": {
        "elastic_emb.keras",
        "elastic_emb.serving",
        "elastic_emb.persistence",
        *TABLES,
    },
    # Data shards handed out through etcd, with a Keras callback (Keras imported lazily).
    "elastic_emb.shard_queue": {"elastic_emb.ps.coord", *TABLES},
    # ee.init: wires the client (and, with several workers, a Keras fix) in.
    "elastic_emb.placement": {
        "elastic_emb.ps.client",
        "elastic_emb.ps.wire",
        "elastic_emb.keras",
        *TABLES,
    },
}
# May import anything: the public names, the CLI, the demo; the one-shot hook that
# imports the Keras package once Keras is imported.
TOP = ("elastic_emb", "elastic_emb.cli", "elastic_emb.examples", "elastic_emb.keras_registration")


def _package_of(module: str) -> str | None:
    found = [p for p in ALLOWED if module == p or module.startswith(p + ".")]
    return max(found, key=len) if found else None


def test_every_module_has_a_place_and_imports_only_downward():
    placed, upward = 0, []
    for name, imported in sorted(_graph().items()):
        if name == "elastic_emb._core" or name == TOP[0] or name.startswith(TOP[1:]):
            continue
        package = _package_of(name)
        assert package is not None, f"{name} is in no package of the map"
        placed += 1
        allowed = ALLOWED[package]
        upward += [
            f"{name} -> {m}"
            for m in sorted(imported)
            if not any(m == a or m.startswith(a + ".") for a in allowed)
        ]
    assert placed > 40
    assert not upward, "imports running up the map:\n" + "\n".join(upward)


# Module (or package prefix) -> what else it must never import, even lazily.
FORBIDDEN = {
    # Tables, their files and exports of rows work without TF, Keras and gRPC.
    "elastic_emb.tables": {"tensorflow", "keras", "grpc"},
    "elastic_emb.persistence": {"tensorflow", "keras", "grpc"},
    "elastic_emb.keras_range": {"tensorflow", "grpc"},
    # Policies check their arguments only; optimizers and initializers import Keras
    # only to convert the user's Keras objects.
    "elastic_emb.tables.policies.admission": {"numpy"},
    "elastic_emb.tables.policies.eviction": {"numpy"},
    "elastic_emb.tables.policies.storage": {"numpy"},
    # The PS never needs TensorFlow or Keras.
    "elastic_emb.ps": {"tensorflow", "keras"},
    # Only the PS package speaks gRPC and protobuf (docs/architecture.md).
    "elastic_emb.keras": {"grpc"},
    # What every Keras backend shares; the JAX layer, in venvs without TensorFlow.
    "elastic_emb.keras.base": {"tensorflow", "jax"},
    "elastic_emb.keras.model_lookups": {"tensorflow", "jax"},
    "elastic_emb.keras.on_jax": {"tensorflow"},
    "elastic_emb.keras.jax_processes": {"tensorflow"},
    "elastic_emb.keras.dense_ps_base": {"tensorflow", "jax"},
    "elastic_emb.keras.compile_hook": {"tensorflow", "jax"},
    "elastic_emb.keras.dense_ps_jax": {"tensorflow"},
    "elastic_emb.keras.jax_ids": {"tensorflow"},
    "elastic_emb.serving": {"grpc"},
    "elastic_emb.placement": {"grpc", "tensorflow"},
    # The library never depends on its examples.
    "elastic_emb.": {"elastic_emb.examples"},
}
# Keras objects, converted when the user passes them.
KERAS_CONVERTERS = (
    "elastic_emb.tables.policies.optimizers",
    "elastic_emb.tables.policies.initializers",
)


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
        if name in KERAS_CONVERTERS:
            imported.discard("keras")
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

    from elastic_emb.ps.client.remote_table import RemoteTable
    from elastic_emb.tables.gpu import GpuTable
    from elastic_emb.tables.local import LocalTable
    from elastic_emb.tables.table import Table

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


def _loaded_in_a_fresh_process(code: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules starting with one of `prefixes` that a fresh process running `code` loads."""
    script = (
        f"import sys\n{code}\nprint(sorted(m for m in sys.modules if m.startswith({prefixes!r})))\n"
    )
    return ast.literal_eval(run_python("-c", script).strip().splitlines()[-1])


def _every_module(package: str, but: tuple[str, ...] = ()) -> str:
    names = sorted(
        n
        for n, p in _modules().items()
        if n.startswith(package) and p.suffix == ".py" and n not in but
    )
    assert len(names) > 1
    return "\n".join(f"import {n}" for n in names)


JAX_ONLY = (
    "elastic_emb.keras.on_jax",
    "elastic_emb.keras.jax_processes",
    "elastic_emb.keras.dense_ps_jax",
    "elastic_emb.keras.jax_ids",
)


def test_the_keras_package_loads_neither_grpc_nor_the_ps_in_a_fresh_process():
    # Transitively: every module of elastic_emb.keras, and a model with a layer, compiled.
    code = (
        f"{_every_module('elastic_emb.keras', but=JAX_ONLY)}\n"
        "import keras, elastic_emb as ee\n"
        "ids = keras.Input((), dtype='int64')\n"
        "keras.Model(ids, ee.Embedding(4, name='t')(ids)).compile('sgd', 'mse')\n"
    )
    prefixes = ("grpc", "grpc_health", "elastic_emb.ps", "elastic_emb._proto")
    assert "elastic_emb.keras.layers" in _loaded_in_a_fresh_process(code, ("elastic_emb.keras",))
    assert _loaded_in_a_fresh_process(code, prefixes) == []


def test_tables_and_their_files_load_neither_tensorflow_keras_nor_grpc_in_a_fresh_process():
    code = f"{_every_module('elastic_emb.tables')}\n{_every_module('elastic_emb.persistence')}"
    prefixes = ("tensorflow", "keras", "grpc", "elastic_emb.ps", "elastic_emb.keras.")
    assert "elastic_emb.tables.tiered" in _loaded_in_a_fresh_process(code, ("elastic_emb.",))
    assert _loaded_in_a_fresh_process(code, prefixes) == []
