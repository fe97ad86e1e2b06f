"""`Embedding` on Keras' JAX backend: the table reached by host callbacks in the jitted step.

Forward: the ids go to the host through an ordered `io_callback`, which looks
their rows up (inserting unseen ids while training) and hands them back. A
Functional (or Sequential) model makes one such callback for all its layers'
calls, ahead of them (`_fused_call`, through `model_lookups`: the part of the
model that computes the ids runs first), as on TensorFlow; a layer called
elsewhere makes its own. Backward (a `jax.custom_vjp` over the same lookups):
one ordered `io_callback` hands the tables the rows' gradient, one row per id,
as on TensorFlow, and its output is the gradient of the layers' push triggers
(zero), so Keras' train step keeps it. Ordered, the callbacks run as traced:
a step's pushes after its pulls, and the next step's pulls (several steps per
execution) after them. A table looked up by several calls in one step sums
their gradients into one push, as on TensorFlow: the backward passes traced
together for a step count them.

JAX holds int64 ids only with 64-bit types on (`JAX_ENABLE_X64=1`); without them
the ids of a model's inputs reach the layer as their two 32-bit halves
(`elastic_emb.keras.jax_ids.SplitIds`), which the callbacks join on the host.
Neither TensorFlow nor `elastic_emb.keras.layers` is imported here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.experimental import io_callback

from elastic_emb.keras import jax_ids, model_lookups, patches
from elastic_emb.keras.base import EmbeddingBase
from elastic_emb.keras.jax_processes import host_callback
from elastic_emb.keras_range import require
from elastic_emb.tables.string_keys import EMPTY_STRING_KEY, string_keys

__all__ = ["Embedding"]


@keras.saving.register_keras_serializable(package="elastic_emb")
class Embedding(EmbeddingBase):
    __doc__ = EmbeddingBase.__doc__
    SUPPORTS_JIT = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _hold_loss_scaled_gradients()
        patches.fuse_functional_lookups(_fused_call)
        jax_ids.feed_halves()
        super().__init__(*args, **kwargs)
        # Ids given as NumPy arrays stay ids (Keras before 3.4 casts them to the compute
        # dtype otherwise, as Keras's own preprocessing layers avoid in the same way).
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True
        if self.device != "cpu":
            raise ValueError(
                'device="gpu" tables are not available on the JAX backend yet (the rows go '
                f"through host memory either way). Received: device={self.device!r}"
            )

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        if jax.default_backend() == "tpu":
            raise ValueError(
                f"elastic_emb.Embedding {self.name!r} is not supported on TPUs: it reaches its "
                "table through host callbacks, untried there. Use CPUs or GPUs."
            )
        ids = self._ids(inputs)
        if self.combiner is not None and ids.ndim != 2:
            raise ValueError(
                "With a `combiner`, dense ids must have shape (batch, k). "
                f"Received: shape={ids.shape}"
            )
        rows = model_lookups.take(self)  # looked up with the model's others
        if rows is None:
            rows = _rows_of([(self, _flat(ids))], training)[0]
        rows = jnp.reshape(rows, (*ids.shape, self.output_dim))
        if self.combiner is not None:
            summed = jnp.sum(rows, axis=1)
            k = rows.shape[1]
            if self.combiner == "mean":
                summed = summed / k
            elif self.combiner == "sqrtn":
                summed = summed / jnp.sqrt(jnp.float32(k))
            rows = summed
        return rows.astype(self.compute_dtype) if self.compute_dtype != "float32" else rows

    @property
    def fusable(self) -> bool:
        """Whether a model may look this layer's rows up with its others' (`_fused_call`):
        not if a subclass has a `call` of its own."""
        return type(self).call is Embedding.call

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        if not self.mask_zero:
            return None
        padding = EMPTY_STRING_KEY if self.key_dtype == "string" else 0
        keys = self._keys_of_strings(inputs)
        if not jax_ids.x64():
            keys = jax_ids.as_split_ids(keys)
        if isinstance(keys, jax_ids.SplitIds):
            halves = jnp.asarray(jax_ids.split(padding)).astype(keys.halves.dtype)
            return jnp.any(keys.halves != halves, axis=-1)
        empty = np.array(padding, np.int64).astype(keys.dtype)  # as uint64 too
        return keras.ops.not_equal(keys, empty)

    def _ids(self, inputs: Any) -> Any:
        """The ids (keys of strings) as a JAX array, or as `SplitIds` where JAX would cut
        them (64-bit types off)."""
        keys = self._keys_of_strings(inputs)
        if not jax_ids.x64():
            keys = jax_ids.as_split_ids(keys)
        if isinstance(keys, jax_ids.SplitIds):
            return keys
        return jnp.asarray(keys)

    def _keys_of_strings(self, inputs: Any) -> Any:
        """With key_dtype="string": ids as their keys. JAX arrays hold no strings, so a
        step gets the keys `ee.string_keys` made in the input pipeline; NumPy strings
        (a call outside a step) are hashed here, on the host."""
        if self.key_dtype != "string":
            return inputs
        if isinstance(inputs, (np.ndarray, list, tuple, str, bytes)):
            if np.asarray(inputs).dtype.kind in "USO":
                return string_keys(inputs)
        dtype = keras.backend.standardize_dtype(inputs.dtype)
        if dtype not in ("int64", "uint64"):
            cut = (
                " (JAX's 64-bit types are off: int64 keys reach the layer whole through a "
                "model input that only elastic_emb layers read, or set JAX_ENABLE_X64=1)"
                if not jax_ids.x64() and dtype in ("int32", "uint32")
                else ""
            )
            raise ValueError(
                f'With key_dtype="string", {self.name!r} takes strings, or on JAX their int64 '
                f"keys from ee.string_keys(strings) in the input pipeline{cut}. "
                f"Received dtype={dtype}"
            )
        return inputs


class _TracedStep:
    """One traced step's pushes: how many per table, and under a LossScaleOptimizer the
    pushes held (scaled) until the step's `settle` has seen whether Keras applied it."""

    def __init__(self, loss_scaled: bool) -> None:
        self.pushes: collections.Counter[int] = collections.Counter()
        self.loss_scaled = loss_scaled
        self.settles = False  # whether the traced step settles its held pushes
        self._held: list[tuple[Any, np.ndarray, np.ndarray]] = []

    def push(self, fusion: Any, keys: np.ndarray, grads: np.ndarray) -> np.ndarray:
        """Pushes a table's gradient, or holds it; the push trigger's gradient: NaN if a
        held gradient overflowed, so that Keras skips the step as for a dense one."""
        if not self.loss_scaled:
            fusion.push_gradient(keys, grads, self.pushes[id(fusion)])
            return np.zeros((1,), np.float32)
        if not self.settles:
            raise RuntimeError("a loss-scaled step traced without its LossScaleOptimizer")
        self._held.append((fusion, keys, grads))
        return np.full((1,), 0.0 if np.isfinite(grads).all() else np.nan, np.float32)

    def settle(self, iterations_before: Any, iterations_after: Any, scale: Any) -> np.ndarray:
        """Pushes the held gradients divided by the step's scale (a power of two: exact)
        if Keras applied the step; drops them if it skipped it."""
        held, self._held = self._held, []
        if int(iterations_after) > int(iterations_before):
            for fusion, keys, grads in held:
                fusion.push_gradient(keys, grads / np.float32(scale), self.pushes[id(fusion)])
        return np.zeros((), np.int32)


class _StepTrace(threading.local):
    """The step being traced: the backward passes of one step are traced together, after
    all its forward passes, so a forward traced after a backward begins the next step (or
    another trace). Inside Keras's train step, whether its optimizer scales the loss."""

    def __init__(self) -> None:
        self.step: _TracedStep | None = None
        self.in_backward = False
        self.train_step_scales_loss: bool | None = None  # None: outside a Keras train step

    def forward(self) -> None:
        if self.in_backward:
            self.step, self.in_backward = None, False

    def backward(self, layer: Embedding, fusion: Any) -> _TracedStep:
        scaled = self.train_step_scales_loss
        if scaled is None and "mixed_float16" in (
            layer.dtype_policy.name,
            keras.config.dtype_policy().name,
        ):
            raise ValueError(
                f"elastic_emb.Embedding {layer.name!r}: under the mixed_float16 policy on JAX "
                "the table trains through Keras's own train step (model.fit, train_on_batch), "
                "where it sees the loss scale; this gradient is taken elsewhere. Use "
                '"mixed_bfloat16", which needs no loss scaling, or float32.'
            )
        if scaled and fusion.two_phase:
            # A skipped step would leave the cluster waiting for pushes that never come.
            raise ValueError(
                "The mixed_float16 policy (loss scaling) trains in-process tables only; the "
                f"table of {layer.name!r} is on parameter servers. Use mixed_bfloat16 (no "
                "loss scaling) or float32."
            )
        if self.step is None:
            self.step = _TracedStep(bool(scaled))
        self.in_backward = True
        self.step.pushes[id(fusion)] += 1
        return self.step


_trace = _StepTrace()


@dataclasses.dataclass
class _Lookup:
    """One layer call's lookup: its table, and whether it inserts ids and is pushed."""

    layer: Embedding
    fusion: Any  # the table's StepFusion
    insert: bool  # training: unseen ids get rows
    expects_push: bool  # a gradient of these ids is pushed in this step

    def flags(self) -> tuple[bool, bool]:
        return self.insert, self.expects_push


def _by_table(indices: list[int], requests: list[_Lookup]) -> list[list[int]]:
    """`indices` grouped by table, each group in its order (a layer called twice)."""
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(id(requests[i].fusion), []).append(i)
    return list(groups.values())


# Threads that share the tables' work of a fused callback with XLA's thread running it.
_WORKERS = min(4, os.cpu_count() or 1)
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()  # guards _pool's creation


def _in_parallel(groups: list[list[int]], work: Callable[[int], None], keys: Any) -> None:
    """`work(i)` for every index of every group, each group's in its order, the groups
    spread over this thread and `_WORKERS - 1` others by their number of keys (the
    tables' C++ calls release the GIL; a table's calls stay in one thread, in order)."""
    global _pool
    parts: list[list[int]] = [[] for _ in range(min(_WORKERS, len(groups)))]
    weights = [0] * len(parts)
    for group in sorted(groups, key=lambda g: -sum(len(keys[i]) for i in g)):
        lightest = weights.index(min(weights))
        parts[lightest] += group
        weights[lightest] += sum(len(keys[i]) for i in group)

    def run(part: list[int]) -> None:
        for i in part:
            work(i)

    if len(parts) < 2:
        return run(parts[0]) if parts else None
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_WORKERS - 1, "ee-jax-tables")
    others = [_pool.submit(run, part) for part in parts[1:]]
    try:
        run(parts[0])
    finally:
        for future in others:
            future.result()


def _flat(ids: Any) -> Any:
    """A call's ids flat, `(n,)`, or as their halves `(n, 2)` (`jax_ids.SplitIds`)."""
    if isinstance(ids, jax_ids.SplitIds):
        return jnp.reshape(ids.halves, (-1, 2))
    return jnp.reshape(ids, (-1,))


def _keys(layer: Embedding, host_ids: Any) -> np.ndarray:
    """The int64 keys of a call's flat ids (`_flat`) as the host gets them."""
    if np.ndim(host_ids) == 2:  # (n, 2): the halves
        return jax_ids.join(host_ids)
    return jax_ids.host_keys(layer.name, host_ids)


def _rows_of(lookups: list[tuple[Embedding, Any]], training: bool | None) -> list[Any]:
    """The float32 `(n, dim)` rows of each layer's flat ids `(n,)`, in one ordered callback
    (remote tables: all submitted, then collected, so a cluster pulls them at once); their
    gradients, where computed, go to the tables in one more."""
    requests = []
    for layer, _ in lookups:
        train = training if layer.trainable else False  # frozen: no rows added, none trained
        requests.append(_Lookup(layer, layer.table.step_fusion(), bool(train), train is not False))
    ids = tuple(i for _, i in lookups)
    shapes = [
        jax.ShapeDtypeStruct((i.shape[0], r.layer.output_dim), jnp.float32)
        for r, i in zip(requests, ids, strict=True)
    ]

    local = _by_table([i for i, r in enumerate(requests) if not r.fusion.two_phase], requests)
    remote = [i for i, r in enumerate(requests) if r.fusion.two_phase]

    def pull(*host_ids: Any) -> list[np.ndarray]:
        keys = [_keys(r.layer, i) for r, i in zip(requests, host_ids, strict=True)]
        out: list[np.ndarray] = [np.empty(0)] * len(requests)
        tickets = [(i, requests[i].fusion.submit(keys[i], *requests[i].flags())) for i in remote]

        def look_up(i: int) -> None:
            out[i] = requests[i].fusion.lookup(keys[i], *requests[i].flags())

        _in_parallel(local, look_up, keys)
        for i, ticket in tickets:
            out[i] = requests[i].fusion.collect(ticket)
        return out

    def _callback(callback: Callable[..., Any], result: Any, *args: Any, summed: bool) -> Any:
        """One layer's lookup: the callback of each JAX process (`host_callback`);
        several, fused (one process only): one ordered callback."""
        if len(requests) > 1:
            return io_callback(callback, result, *args, ordered=True)
        layer = requests[0].layer
        return host_callback(layer.name, layer.table.cluster, callback, result, *args,
                             summed=summed)  # fmt: skip

    def looked_up(ids: tuple[Any, ...]) -> list[Any]:
        if len(requests) == 1:
            first = functools.wraps(pull)(lambda host_ids: pull(host_ids)[0])
            return [_callback(first, shapes[0], ids[0], summed=False)]
        return list(_callback(pull, shapes, *ids, summed=False))

    pushing = [i for i, r in enumerate(requests) if r.expects_push]
    if not pushing:
        return looked_up(ids)
    pushing_local = _by_table([i for i in pushing if not requests[i].fusion.two_phase], requests)
    pushing_remote = [i for i in pushing if requests[i].fusion.two_phase]

    @jax.custom_vjp
    def pushed_rows(ids: tuple[Any, ...], triggers: tuple[Any, ...]) -> list[Any]:
        return looked_up(ids)

    def forward(ids: tuple[Any, ...], triggers: tuple[Any, ...]) -> tuple[list[Any], Any]:
        _trace.forward()
        return looked_up(ids), ids

    def backward(ids: tuple[Any, ...], upstream: list[Any]) -> tuple[Any, Any]:
        # Each call counts one push of its table, all in the step being traced.
        step = [_trace.backward(requests[i].layer, requests[i].fusion) for i in pushing][-1]

        def push(*arrays: Any) -> np.ndarray:
            n = len(pushing)
            keys = {
                i: _keys(requests[i].layer, a) for i, a in zip(pushing, arrays[:n], strict=True)
            }
            grads = dict(zip(pushing, arrays[n:], strict=True))
            finite: dict[int, bool] = {}

            def push_one(i: int) -> None:
                trigger = step.push(requests[i].fusion, keys[i], np.asarray(grads[i], np.float32))
                finite[i] = not np.isnan(trigger).any()

            # The local tables in parallel; the remote ones (queued, sent as one) here.
            _in_parallel(pushing_local, push_one, keys)
            for i in pushing_remote:
                push_one(i)
            return np.full((1,), 0.0 if all(finite.values()) else np.nan, np.float32)

        trigger_grad = _callback(
            push,
            jax.ShapeDtypeStruct((1,), jnp.float32),
            *(ids[i] for i in pushing),
            *(upstream[i].astype(jnp.float32) for i in pushing),
            summed=True,
        )
        return tuple(None for _ in ids), tuple(trigger_grad for _ in triggers)

    pushed_rows.defvjp(forward, backward)
    # Each layer's push trigger once (a layer called twice has one).
    triggers = {id(r.layer): r.layer.push_trigger.value for r in requests if r.expects_push}
    return list(pushed_rows(ids, tuple(triggers.values())))


def _fused_call(model: Any, inputs: Any, training: bool | None, call: Callable[[], Any]) -> Any:
    """`call()`, the Functional `model` run on `inputs`, with the lookups of its
    `ee.Embedding` calls made together, ahead of the model (`model_lookups`): one
    callback per direction for all of them. Only while JAX traces (a jitted step), and
    only where the plan is exact; otherwise each layer looks up on its own."""
    if not any(isinstance(x, jax.core.Tracer) for x in keras.tree.flatten(inputs)):
        return call()
    plan = model_lookups.plan_of(model, Embedding)
    if plan is None or len(plan.layers) < 2 or jax.process_count() > 1:
        return call()  # (several JAX processes: each lookup's own per-process callback)
    ids = model_lookups.ids_of(plan, model, inputs)
    flat = [_flat(layer._ids(x)) for layer, x in zip(plan.layers, ids, strict=True)]
    rows = _rows_of(list(zip(plan.layers, flat, strict=True)), training)
    return model_lookups.run_with_rows(model, plan, rows, call)


def _hold_loss_scaled_gradients() -> None:
    """Wraps Keras's train step (where the model says whether its optimizer scales the
    loss) and `LossScaleOptimizer.stateless_apply` (which settles the step's held pushes
    once Keras has applied or skipped it), once. The tables then train on the true
    gradient in the steps Keras applies, as on TensorFlow (`loss_scaling`)."""
    trainer = next(c for c in keras.Model.__mro__ if "train_step" in vars(c))
    if getattr(trainer.train_step, "_ee_wrapped", False):
        return
    keras_train_step = trainer.train_step
    keras_apply = keras.optimizers.LossScaleOptimizer.stateless_apply

    @functools.wraps(keras_train_step)
    def train_step(self: keras.Model, state: Any, data: Any) -> Any:
        outer = _trace.train_step_scales_loss
        _trace.step, _trace.in_backward = None, False
        _trace.train_step_scales_loss = isinstance(
            self.optimizer, keras.optimizers.LossScaleOptimizer
        )
        try:
            return keras_train_step(self, state, data)
        finally:
            _trace.train_step_scales_loss = outer

    @functools.wraps(keras_apply)
    def stateless_apply(self: Any, optimizer_variables: Any, grads: Any, variables: Any) -> Any:
        step = _trace.step if _trace.train_step_scales_loss and _trace.in_backward else None
        result = keras_apply(self, optimizer_variables, grads, variables)
        if step is None or step.settles:
            return result
        index = {id(v): i for i, v in enumerate(self.variables)}
        iterations = index.get(id(self.inner_optimizer.iterations))
        scale = index.get(id(self.dynamic_scale))
        require(
            iterations is not None and scale is not None,
            "LossScaleOptimizer.inner_optimizer.iterations and .dynamic_scale among its variables",
            "mixed_float16 on JAX",
        )
        step.settles = True
        io_callback(
            step.settle,
            jax.ShapeDtypeStruct((), jnp.int32),
            optimizer_variables[iterations],
            result[1][iterations],
            optimizer_variables[scale],
            ordered=True,
        )
        return result

    train_step._ee_wrapped = True  # type: ignore[attr-defined]
    trainer.train_step = train_step
    keras.optimizers.LossScaleOptimizer.stateless_apply = stateless_apply
