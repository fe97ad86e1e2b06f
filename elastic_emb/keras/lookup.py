"""How `ee.Embedding` layers reach their tables: one call per direction for many lookups.

`rows_of(lookups, training)` looks up the ids of many (layer, ids) pairs in
one `tf.numpy_function` (remote tables: one to submit, one to collect) and
pushes all their gradients in one more. Each such call costs about 0.1 ms of
TensorFlow runtime whatever it does, which at 26 tables is most of what the
lookups cost. A layer called on its own makes one lookup; a Functional (or
Sequential) model makes one for all its `ee.Embedding` calls at once
(`fused_call`, which keras_patches hooks into `Functional.call`): before the
model runs, the part of the model that computes the layers' ids runs, the
rows of all of them are looked up together, and each layer takes its rows.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

from elastic_emb.keras import loss_scaling, model_lookups
from elastic_emb.tables.table import StepFusion

if TYPE_CHECKING:
    from elastic_emb.keras.layers import Embedding

__all__ = ["fused_call", "local_replicas", "lookahead", "rows_of", "take"]


def local_replicas() -> int:
    """Replicas of the current strategy in this process (1 without a strategy)."""
    if not tf.distribute.has_strategy():
        return 1
    return len(tf.distribute.get_strategy().extended.worker_devices)


@dataclasses.dataclass
class _Request:
    fusion: StepFusion
    dim: int
    insert: bool  # training: unseen ids get rows
    expects_push: bool  # a gradient of these ids is pushed in this step


def rows_of(lookups: list[tuple[Embedding, tf.Tensor]], training: bool | None) -> list[tf.Tensor]:
    """The float32 `(n, dim)` rows of each layer's int64 `(n,)` ids, pushed back together.

    The gradients of all the rows go to their tables in one call, whose
    output is the gradient of every layer's push trigger, so it runs once
    per step whatever optimizer `model.compile` uses. Remote tables are
    reached in two phases (all lookups of a traced step submit before any
    collects, so a cluster pulls for all of them at once).
    """
    requests = []
    for layer, _ in lookups:
        train = training if layer.trainable else False  # frozen: no rows added, none trained
        requests.append(
            _Request(layer.table.step_fusion(), layer.output_dim, bool(train), train is not False)
        )
    ids = [keys for _, keys in lookups]
    triggers = list({id(layer): layer.push_trigger for layer, _ in lookups}.values())
    trigger_reads = [tf.convert_to_tensor(t) for t in triggers]
    if not any(r.expects_push for r in requests):
        return _pull(requests, ids, trigger_reads[0])

    pushing = [i for i, r in enumerate(requests) if r.expects_push]
    # How many pushes each table gets per run of the traced step: one per
    # lookup whose gradient the step computes, on every replica. Eagerly, a
    # push is a step of its own (one per replica).
    step_pushes: collections.Counter[int] | None = None
    eager_pushes = local_replicas()

    held = [loss_scaling.steps_of(layer) for layer, _ in lookups]

    def push(*arrays: np.ndarray) -> np.ndarray:
        keys, grads = arrays[: len(pushing)], arrays[len(pushing) :]
        finite = True
        for i, k, g in zip(pushing, keys, grads, strict=True):
            fusion = requests[i].fusion
            pushes = eager_pushes if step_pushes is None else step_pushes[id(fusion)]
            steps = held[i]
            if steps is None:
                fusion.push_gradient(k, g, pushes)
            else:  # (loss-scaled: pushed once Keras has applied the step)
                finite = steps.hold(fusion, k, g, pushes) and finite
        # A NaN trigger gradient makes a LossScaleOptimizer skip the step.
        return np.full((1,), 0.0 if finite else np.nan, np.float32)

    @tf.custom_gradient
    def looked_up(*inputs: tf.Tensor) -> Any:
        ids, reads = list(inputs[: len(requests)]), list(inputs[len(requests) :])

        def grad(*upstream: tf.Tensor) -> list[tf.Tensor | None]:
            nonlocal step_pushes
            if not tf.executing_eagerly():  # traced: count this step's pushes per table
                graph = tf.compat.v1.get_default_graph()
                step_pushes = _STEP_PUSHES.setdefault(graph, collections.Counter())
                step_pushes.update(id(requests[i].fusion) for i in pushing)
            pushed = tf.numpy_function(
                push,
                [ids[i] for i in pushing] + [tf.cast(upstream[i], tf.float32) for i in pushing],
                tf.float32,
                stateful=True,
            )
            return [None] * len(ids) + [tf.reshape(pushed, [1])] * len(reads)

        return _pull(requests, ids, reads[0]), grad

    return list(looked_up(*ids, *trigger_reads))


# Per traced step: how many pushes each table (its StepFusion's id) gets per run.
_STEP_PUSHES: weakref.WeakKeyDictionary[Any, collections.Counter[int]] = weakref.WeakKeyDictionary()


def _pull(requests: list[_Request], ids: list[tf.Tensor], trigger: tf.Tensor) -> list[tf.Tensor]:
    """The forward ops: rows of every request (the trigger read keeps constant ids unfolded)."""
    local = [i for i, r in enumerate(requests) if not r.fusion.two_phase]
    remote = [i for i, r in enumerate(requests) if r.fusion.two_phase]

    def submit(*keys: np.ndarray) -> np.ndarray:
        tickets = [
            requests[i].fusion.submit(k, requests[i].insert, requests[i].expects_push)
            for i, k in zip(remote, keys[: len(remote)], strict=True)
        ]
        return np.array(tickets, np.int64)

    # The local lookups of one table (a table shared by several features or layers) in one
    # call: [(positions in `local`, its request)].
    by_table: dict[tuple[int, bool], list[int]] = {}
    for n, i in enumerate(local):
        by_table.setdefault((id(requests[i].fusion), requests[i].insert), []).append(n)

    def lookup(*arrays: np.ndarray) -> list[np.ndarray]:
        out: list[np.ndarray] = [np.empty(0)] * len(requests)
        for lookups in by_table.values():
            first = requests[local[lookups[0]]]
            push = any(requests[local[n]].expects_push for n in lookups)
            keys = [arrays[n] for n in lookups]
            rows = first.fusion.lookup(
                keys[0] if len(keys) == 1 else np.concatenate(keys), first.insert, push
            )
            ends = np.cumsum([len(k) for k in keys])
            for n, part in zip(lookups, np.split(rows, ends[:-1]), strict=True):
                out[local[n]] = part
        if remote:
            for i, ticket in zip(remote, arrays[len(local)], strict=True):
                out[i] = requests[i].fusion.collect(int(ticket))
        return out

    inputs = [ids[i] for i in local]
    tickets = None
    if remote:
        tickets = tf.numpy_function(
            submit, [ids[i] for i in remote] + [trigger], tf.int64, stateful=False
        )
        inputs.append(tickets)
    # (One output comes back unlisted.)
    rows = tf.nest.flatten(
        tf.numpy_function(lookup, [*inputs, trigger], [tf.float32] * len(requests), stateful=False)
    )
    if tickets is not None:
        _fuse_pulls(tickets, rows[0])
    for r, keys, request in zip(rows, ids, requests, strict=True):
        r.set_shape([keys.shape[0], request.dim])
    return list(rows)


# Per graph: the barrier every remote pull waits behind, and the pulls.
_PULL_BARRIERS: weakref.WeakKeyDictionary[Any, tuple[Any, set[Any]]] = weakref.WeakKeyDictionary()


def _fuse_pulls(ticket: tf.Tensor, rows: tf.Tensor) -> None:
    """Orders every key submission of a graph before any collection.

    All lookups of a traced step submit their keys first; the first collect
    of a remote table then sends one fused Pull per shard for all of them.
    (Without this, TF runs each lookup's submit and collect back to back.)
    Skipped when the keys depend on another lookup's rows, which would make
    a cycle.
    """
    if tf.executing_eagerly():
        return
    submit, collect = ticket.op, rows.op
    graph = submit.graph
    entry = _PULL_BARRIERS.get(graph)
    if entry is None:
        with tf.control_dependencies(None):
            barrier = tf.no_op(name="ee_pull_barrier")
        entry = _PULL_BARRIERS[graph] = (barrier, set())
    barrier, collects = entry
    if _depends_on(submit, collects | {barrier}):
        return
    barrier._add_control_input(submit)
    collect._add_control_input(barrier)
    collects.add(collect)


def _depends_on(op: tf.Operation, targets: set[Any]) -> bool:
    """Whether any of `targets` is an ancestor of `op`."""
    seen: set[Any] = set()
    stack = [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent in targets:
                return True
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return False


# A Functional model's lookups, fused.


def fused_call(
    layer_type: type[Embedding],
    model: Any,
    inputs: Any,
    training: bool | None,
    call: Callable[[], Any],
) -> Any:
    """`call()`, the Functional `model` run on `inputs`, with its `layer_type` lookups fused.

    Only while a `tf.function` is traced (`model.fit`, `evaluate`,
    `predict`), and only where it is exact: the model calls at least two
    `ee.Embedding` layers, each on one positional input, and no id depends
    on a layer with state (weights, random seeds) or on another lookup's
    rows (`model_lookups.plan_of`). Otherwise every layer looks up on its own.
    """
    if tf.executing_eagerly():
        return call()
    plan = model_lookups.plan_of(model, layer_type)
    if (
        plan is None
        or len(plan.layers) < 2  # nothing to fuse
        or any(layer.serving_table is not None for layer in plan.layers)
    ):
        return call()
    keys = _keys_of(plan, model, inputs)
    rows = rows_of(list(zip(plan.layers, keys, strict=True)), training)
    return model_lookups.run_with_rows(model, plan, rows, call)


def take(layer: Embedding) -> tf.Tensor | None:
    """The rows `fused_call` looked up for this call of `layer`, if it did."""
    return model_lookups.take(layer)


def lookahead(layer_type: type[Embedding], dataset: tf.data.Dataset, model: Any) -> Any:
    """`dataset`, telling the tables each batch's ids one training step ahead."""
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"ee.lookahead takes a tf.data.Dataset. Received: {type(dataset).__name__}")
    if isinstance(model, keras.Sequential):
        model = model._functional  # what Sequential.call runs (None before it is built)
    if not isinstance(model, keras.Model) or not hasattr(model, "_nodes_by_depth"):
        raise ValueError(
            "ee.lookahead needs a Functional or Sequential Keras model (it runs the part of "
            f"the model that computes the ids). Received: {type(model).__name__}"
        )
    plan = model_lookups.plan_of(model, layer_type)
    if plan is None:
        raise ValueError(
            f"Model {model.name!r} has no ee.Embedding call whose ids ee.lookahead can "
            "compute ahead (none, or ids computed by layers with state, or a call with "
            "more than one argument: see docs/architecture.md)."
        )

    if not any(layer.table.step_fusion().two_phase for layer in plan.layers):
        return dataset  # in-process tables answer at once: nothing to read ahead

    def announce(*keys: np.ndarray) -> np.ndarray:
        groups: dict[int, tuple[Any, list[Any]]] = {}
        for layer, k in zip(plan.layers, keys, strict=True):
            ahead = layer.table.step_fusion().read_ahead(k)
            if ahead is not None:
                groups.setdefault(id(ahead[0]), (ahead[0], []))[1].append(ahead[1])
        for group, tables in groups.values():
            group.prefetch(tables)
        return np.zeros((), np.int64)

    def tap(*batch: Any) -> Any:
        x = batch[0]  # (x, y, sample_weight) as Keras takes them, or x alone
        told = tf.numpy_function(announce, _keys_of(plan, model, x), tf.int64, stateful=True)
        with tf.control_dependencies([told]):
            batch = tf.nest.map_structure(tf.identity, batch)
        return batch if len(batch) > 1 else batch[0]

    # One batch ready ahead: the next batch is announced as the model takes this one.
    return dataset.map(tap).prefetch(1)


def _keys_of(plan: model_lookups.Plan, model: Any, inputs: Any) -> list[tf.Tensor]:
    """Each planned call's flat int64 keys, computed from the model's `inputs`."""
    ids = model_lookups.ids_of(plan, model, inputs)
    return [layer.flat_keys(x) for layer, x in zip(plan.layers, ids, strict=True)]
