"""A Functional model's `ee.Embedding` calls, planned so that their lookups run together.

What both backends' fused lookups share (`elastic_emb.keras.lookup.fused_call` on
TensorFlow, `elastic_emb.keras.on_jax` on JAX), with Keras alone: the plan of a model
(its layers' calls in the order Keras runs them, and the sub-model that computes their
ids from the model's inputs), the ids of each planned call, and the rows looked up
ahead, handed to each call as the model runs (`take`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

import keras

__all__ = ["Plan", "ids_of", "plan_of", "run_with_rows", "take"]


@dataclasses.dataclass
class Plan:
    """The `ee.Embedding` calls of a Functional model, and the sub-model of their ids."""

    layers: list[Any]
    ids: keras.Function  # model inputs -> each call's ids, in the order Keras runs the calls


_PLANS: weakref.WeakKeyDictionary[Any, Plan | None] = weakref.WeakKeyDictionary()
# Per thread (each replica of a strategy calls the model in its own): rows
# looked up for layers not called yet, innermost model last.
_pending = threading.local()


def plan_of(model: Any, layer_type: type) -> Plan | None:
    """The plan of `model`'s `layer_type` calls; None where fusing them would not be exact:
    not a Functional model, a layer that is not `fusable` or takes more than one positional
    input, or ids computed by layers with state (weights, random seeds) or from rows."""
    if model not in _PLANS:
        _PLANS[model] = _plan(model, layer_type)
    return _PLANS[model]


def ids_of(plan: Plan, model: Any, inputs: Any) -> list[Any]:
    """Each planned call's ids (its input, as the model computes it), from `inputs`."""
    return list(plan.ids._run_through_graph(model._standardize_inputs(inputs), lambda op: op))


def run_with_rows(model: Any, plan: Plan, rows: list[Any], call: Callable[[], Any]) -> Any:
    """`call()` (the model's own run), each planned call `take`ing its `rows`."""
    waiting: dict[int, collections.deque[Any]] = collections.defaultdict(collections.deque)
    for layer, r in zip(plan.layers, rows, strict=True):
        waiting[id(layer)].append(r)
    stack = _pending.__dict__.setdefault("stack", [])
    stack.append(waiting)
    try:
        outputs = call()
    finally:
        stack.pop()
    if any(waiting.values()):
        raise RuntimeError(
            f"elastic_emb: model {model.name!r} did not call its ee.Embedding layers as "
            "its graph says (a fused lookup went unused). Please report this."
        )
    return outputs


def take(layer: Any) -> Any:
    """The rows looked up ahead for this call of `layer` (`run_with_rows`), or None."""
    for waiting in reversed(getattr(_pending, "stack", [])):
        rows = waiting.get(id(layer))
        if rows:
            return rows.popleft()
    return None


def _plan(model: Any, layer_type: type) -> Plan | None:
    if not hasattr(model, "_nodes_by_depth"):  # (another Keras: each layer looks up alone)
        return None
    nodes = [
        node
        for depth in sorted(model._nodes_by_depth, reverse=True)  # Keras' own order
        for node in model._nodes_by_depth[depth]
        if isinstance(node.operation, layer_type)
    ]
    # A subclass with its own lookup is left to it.
    fusable = all(
        node.operation.fusable and len(node.arguments.args) == 1 and not node.arguments.kwargs
        for node in nodes
    )
    if not nodes or not fusable:
        return None
    ids = keras.Function(model.inputs, [node.arguments.args[0] for node in nodes])
    for op in ids.operations:
        if isinstance(op, keras.layers.InputLayer):
            continue
        # Ids computed from state, random numbers or rows: run in Keras' order.
        if isinstance(op, layer_type | keras.Model) or _has_state(op):
            return None
    return Plan([node.operation for node in nodes], ids)


def _has_state(op: Any) -> bool:
    """Weights or random seeds: running the op twice could change what it computes."""
    return (
        bool(getattr(op, "weights", None))
        or bool(getattr(op, "_seed_generators", None))
        or any(isinstance(v, keras.random.SeedGenerator) for v in vars(op).values())
    )
