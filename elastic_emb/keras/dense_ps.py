"""Dense weights on the parameter servers on Keras' TensorFlow backend: `ee.init(..., dense="ps")`.

What the feature does, and the host side shared with JAX, is in
`elastic_emb.keras.dense_ps_base`. Here, a compiled model's `train_step`,
`test_step` and `predict_step` are wrapped to pull the dense rows first
(`tf.numpy_function`) and assign the variables; its optimizer's
`apply_gradients` hands the dense variables' gradients to the step's fused
push instead of applying them.
"""

from __future__ import annotations

import functools
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from elastic_emb.keras import dense_ps_base
from elastic_emb.keras.dense_ps_base import ROW_WIDTH, DenseOnPS

__all__ = ["ROW_WIDTH", "DenseOnPS", "attach"]


def _assign(on_ps: DenseOnPS, rows: tf.Tensor) -> None:
    flat = tf.reshape(rows, [-1])
    start = 0
    for variable, size, count in zip(on_ps.variables, on_ps.sizes, on_ps.rows, strict=True):
        variable.assign(tf.reshape(flat[start : start + size], variable.shape))
        start += count * ROW_WIDTH


def _pull(on_ps: DenseOnPS, training: bool) -> None:
    """In a traced step: assigns the variables the rows of this step (training: in the
    step's fused pull, which counts on this step's push)."""
    if not len(on_ps.keys):  # a model of tables only
        return
    rows = tf.numpy_function(lambda: on_ps.step_rows(training), [], tf.float32, stateful=True)
    _assign(on_ps, tf.reshape(rows, [len(on_ps.keys), ROW_WIDTH]))


def _push(on_ps: DenseOnPS, grads_and_vars: list[tuple[Any, Any]]) -> tf.Tensor:
    """In a traced step: sends the dense variables' gradients (a variable without one
    gets zeros) into the step's fused push; returns the op's output."""
    if not len(on_ps.keys):
        return tf.zeros([1])
    grads = {id(v): g for g, v in grads_and_vars if g is not None}
    parts = []
    for variable, size, count in zip(on_ps.variables, on_ps.sizes, on_ps.rows, strict=True):
        grad = grads.get(id(variable))
        flat = tf.zeros([size]) if grad is None else tf.reshape(tf.cast(grad, tf.float32), [-1])
        parts.append(tf.pad(flat, [[0, count * ROW_WIDTH - size]]))
    rows = tf.reshape(tf.concat(parts, 0), [len(on_ps.keys), ROW_WIDTH])

    def send(rows: np.ndarray) -> np.ndarray:
        on_ps.push_rows(rows)
        return np.zeros((1,), np.float32)

    return tf.numpy_function(send, [rows], tf.float32, stateful=True)


def attach(model: keras.Model) -> None:
    """After `model.compile`: routes the model's dense weights through the PS when
    `ee.init(dense="ps")` is in effect (else does nothing). Compiling again re-attaches
    (to the new optimizer) without wrapping twice."""
    found = dense_ps_base.dense_cluster(model)
    if found is None:
        return
    cluster, chosen = found
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync > 1:
        if not chosen:  # the default: a strategy's all-reduce keeps them, as before
            return
        raise ValueError(
            f"dense='ps' trains dense weights without a tf.distribute strategy; model "
            f"{model.name!r} was built under {type(strategy).__name__} with "
            f"{strategy.num_replicas_in_sync} replicas. Build it outside the strategy's scope, "
            "or pass dense='local'."
        )

    def stepped(step: Any, training: bool) -> Any:
        @functools.wraps(step)
        def run(data: Any) -> Any:
            _pull(dense(), training)
            return step(data)

        return run

    def wrap(originals: dict[str, Any], _: Any) -> dict[str, Any]:
        return {
            "train_step": stepped(originals["train_step"], True),
            "test_step": stepped(originals["test_step"], False),
            "predict_step": stepped(originals["predict_step"], False),
        }

    # (first made while a step is traced: run it now)
    dense = dense_ps_base.attach_model(
        model, cluster, ("train_step", "test_step", "predict_step"), wrap, tf.init_scope
    )
    optimizer = model.optimizer
    apply_gradients = optimizer.apply_gradients

    @functools.wraps(apply_gradients)
    def apply_gradients_on_ps(grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        on_ps = dense()
        pushed = _push(on_ps, [(g, v) for g, v in pairs if on_ps.holds(v)])
        with tf.control_dependencies([pushed]):
            rest = [(g, v) for g, v in pairs if not on_ps.holds(v)]
            return apply_gradients(rest, *args, **kwargs) if rest else optimizer.iterations

    object.__setattr__(optimizer, "apply_gradients", apply_gradients_on_ps)
