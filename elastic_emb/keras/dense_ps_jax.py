"""Dense weights on the parameter servers on Keras' JAX backend: `ee.init(..., dense="ps")`.

What the feature does, the table and its layout (the same as on TensorFlow)
are in `elastic_emb.keras.dense_ps_base`. Keras's JAX steps are stateless
(`train_step(state, data) -> (logs, state)`), so here a compiled model's
`train_step`, `test_step` and `predict_step` are wrapped to put the PS's
values in the state they get: an ordered `io_callback` at the step's start
pulls the dense rows (in the step's pull: training steps count on their push)
and they replace the dense trainable variables' values. The optimizer's `apply`
(which Keras's `stateless_apply` runs) hands the dense variables' gradients to
the step's fused push with another ordered `io_callback`, after the tables'
pushes of the backward pass, and applies the rest (the tables' push triggers)
as Keras does. Ordered, the callbacks run as traced: a step's pushes after its
pulls, the next step's pulls after them.

`make_train_function`, `make_test_function` and `make_predict_function` are
wrapped too: the table is made (and the first worker's initial values stored)
before the first step is traced, while the variables hold values. Imports no
TensorFlow.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.experimental import io_callback

from elastic_emb.keras import dense_ps_base
from elastic_emb.keras.compile_hook import after_compile
from elastic_emb.keras.dense_ps_base import DenseOnPS

__all__ = ["attach", "install"]

_STEPS = ("train_step", "test_step", "predict_step")
_MAKERS = ("make_train_function", "make_test_function", "make_predict_function")


def install() -> None:
    """Attaches every model compiled from now on (idempotent)."""
    after_compile(attach)


def _pulled(model: keras.Model, on_ps: DenseOnPS, values: Any, training: bool) -> list[Any]:
    """In a traced step: the trainable variables' `values` (in `model.trainable_variables`'
    order) with the dense ones replaced by the rows of this step."""
    if not len(on_ps.keys):  # a model of tables only
        return list(values)
    shapes = [
        jax.ShapeDtypeStruct(tuple(v.shape), jnp.dtype(keras.backend.standardize_dtype(v.dtype)))
        for v in on_ps.variables
    ]
    pulled = io_callback(lambda: on_ps.values_of(on_ps.step_rows(training)), shapes, ordered=True)
    index = {id(v): i for i, v in enumerate(model.trainable_variables)}
    values = list(values)
    for variable, value in zip(on_ps.variables, pulled, strict=True):
        values[index[id(variable)]] = value
    return values


def _push(on_ps: DenseOnPS, grads: dict[int, Any]) -> None:
    """In a traced step: sends the dense variables' gradients (`grads` by variable id; a
    variable without one gets zeros) into the step's fused push."""
    if not len(on_ps.keys):
        return
    parts = [
        jnp.zeros(v.shape, jnp.float32)
        if grads.get(id(v)) is None
        else jnp.asarray(grads[id(v)], jnp.float32)
        for v in on_ps.variables
    ]

    def send(*parts: Any) -> np.ndarray:
        on_ps.push_rows(on_ps._rows_of(list(parts)))
        return np.zeros((1,), np.float32)

    io_callback(send, jax.ShapeDtypeStruct((1,), jnp.float32), *parts, ordered=True)


def attach(model: keras.Model) -> None:
    """After `model.compile`: routes the model's dense weights through the PS when
    `ee.init(dense="ps")` is in effect (else does nothing). Compiling again re-attaches
    (to the new optimizer) without wrapping twice."""
    found = dense_ps_base.dense_cluster(model)
    if found is None:
        return
    cluster, chosen = found
    distribution = keras.distribution.distribution()
    if distribution is not None:
        if not chosen:  # the default: the distribution keeps them, as on TensorFlow
            return
        raise ValueError(
            f"dense='ps' trains dense weights without a keras.distribution; model "
            f"{model.name!r} is compiled under {type(distribution).__name__}. Compile it "
            "outside the distribution's scope, or pass dense='local'."
        )

    def stepped(step: Any, training: bool) -> Any:
        @functools.wraps(step)
        def run(state: Any, data: Any) -> Any:
            trainable, *rest = state
            return step((_pulled(model, dense(), trainable, training), *rest), data)

        return run

    def made_first(make: Any) -> Any:
        @functools.wraps(make)
        def run(*args: Any, **kwargs: Any) -> Any:
            dense()  # (before a step is traced: the variables hold values now)
            return make(*args, **kwargs)

        return run

    def wrap(originals: dict[str, Any], _: Any) -> dict[str, Any]:
        steps = {name: stepped(originals[name], name == "train_step") for name in _STEPS}
        return steps | {name: made_first(originals[name]) for name in _MAKERS}

    dense = dense_ps_base.attach_model(model, cluster, (*_STEPS, *_MAKERS), wrap)
    optimizer = model.optimizer
    keras_apply = optimizer.__dict__.get("_ee_keras_apply") or optimizer.apply

    @functools.wraps(keras_apply)
    def apply_on_ps(grads: Any, trainable_variables: Any = None) -> Any:
        variables = (
            model.trainable_variables if trainable_variables is None else trainable_variables
        )
        pairs = list(zip(grads, variables, strict=True))
        on_ps = dense()
        _push(on_ps, {id(v): g for g, v in pairs if on_ps.holds(v)})
        rest = [(g, v) for g, v in pairs if not on_ps.holds(v)]
        if not rest:
            return None
        return keras_apply([g for g, _ in rest], [v for _, v in rest])

    object.__setattr__(optimizer, "_ee_keras_apply", keras_apply)  # (compiled again: once)
    object.__setattr__(optimizer, "apply", apply_on_ps)
