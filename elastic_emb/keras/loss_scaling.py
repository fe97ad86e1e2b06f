"""`mixed_float16`: the tables train on the true gradient, in the steps Keras applies.

Under the `mixed_float16` policy `model.compile` wraps its optimizer in a
`keras.optimizers.LossScaleOptimizer`: the loss is multiplied by a dynamic
scale, so every gradient is too, and a step whose scaled gradients are not all
finite is skipped (the scale halves). The tables' gradients are pushed during
the backward pass, before Keras has decided. So, for a model compiled with a
`LossScaleOptimizer`, `attach` makes its layers hold their gradients back
(`LossScaledSteps.hold`) and wraps the optimizer's public `apply`: once Keras
has applied or skipped the step, the held gradients are divided by the scale
the step used (a power of two: exact) and pushed, or dropped with the step.
A held gradient that is not finite makes the step's push-trigger gradient NaN,
so Keras skips the whole step, as it does when a stock embedding's gradient
overflows.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

if TYPE_CHECKING:
    from elastic_emb.keras.layers import Embedding
    from elastic_emb.tables.table import StepFusion

__all__ = ["LossScaledSteps", "attach", "steps_of"]

# Each layer of a model compiled with a LossScaleOptimizer -> that optimizer's steps.
_STEPS: weakref.WeakKeyDictionary[Any, LossScaledSteps] = weakref.WeakKeyDictionary()


class LossScaledSteps:
    """The table gradients of the current step of one `LossScaleOptimizer`, held until
    Keras has applied or skipped the step. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _held
        self._held: list[tuple[StepFusion, np.ndarray, np.ndarray, int]] = []

    def hold(self, fusion: StepFusion, keys: np.ndarray, grads: np.ndarray, pushes: int) -> bool:
        """Holds one push (`StepFusion.push_gradient`'s arguments); whether it is finite."""
        with self._lock:
            self._held.append((fusion, keys, grads, pushes))
        return bool(np.isfinite(grads).all())

    def settle(self, iterations_before: np.ndarray, iterations_after: np.ndarray,
               scale: np.ndarray) -> np.ndarray:  # fmt: skip
        """Pushes the held gradients, unscaled, if the step was applied; else drops them."""
        with self._lock:
            held, self._held = self._held, []
        if int(iterations_after) > int(iterations_before):
            for fusion, keys, grads, pushes in held:
                fusion.push_gradient(keys, grads / np.float32(scale), pushes)
        return np.zeros((), np.int64)


def steps_of(layer: Embedding) -> LossScaledSteps | None:
    """The loss-scaled steps `layer`'s gradients are held for, if any."""
    return _STEPS.get(layer)


def attach(model: keras.Model, layers: list[Embedding]) -> None:
    """After `model.compile`: holds the gradients of `layers` for the model's
    `LossScaleOptimizer`, if it has one (else releases them)."""
    optimizer = model.optimizer
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        for layer in layers:
            _STEPS.pop(layer, None)
        return
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync > 1:
        raise ValueError(
            "elastic_emb.Embedding trains under the mixed_float16 policy (loss scaling) on one "
            f"replica; model {model.name!r} is compiled under {type(strategy).__name__} with "
            f"{strategy.num_replicas_in_sync} replicas. Use mixed_bfloat16 (no loss scaling), "
            "or one replica."
        )
    remote = [layer.name for layer in layers if layer.table.step_fusion().two_phase]
    if remote:
        # A skipped step would leave the cluster waiting for pushes that never come.
        raise ValueError(
            "The mixed_float16 policy (loss scaling) trains in-process tables only; the "
            f"tables of {remote} are on parameter servers. Use mixed_bfloat16 (no loss "
            "scaling) or float32."
        )
    if "_ee_dense_originals" in model.__dict__:
        raise ValueError(
            "ee.init(dense='ps') does not train under the mixed_float16 policy (loss scaling); "
            "use mixed_bfloat16 or float32"
        )
    steps = optimizer.__dict__.get("_ee_loss_scaled_steps")
    if steps is None:
        steps = LossScaledSteps()
        object.__setattr__(optimizer, "_ee_loss_scaled_steps", steps)
        keras_apply = optimizer.apply

        @functools.wraps(keras_apply)
        def apply(grads: Any, trainable_variables: Any = None) -> Any:
            before = tf.identity(optimizer.inner_optimizer.iterations)
            scale = tf.identity(optimizer.scale_loss(tf.constant(1.0, tf.float32)))
            with tf.control_dependencies([before, scale]):
                result = keras_apply(grads, trainable_variables)
            after = tf.identity(optimizer.inner_optimizer.iterations)
            tf.numpy_function(steps.settle, [before, after, scale], tf.int64, stateful=True)
            return result

        object.__setattr__(optimizer, "apply", apply)
    for layer in layers:
        _STEPS[layer] = steps
