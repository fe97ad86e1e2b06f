"""Multi-worker training support: a fix for Keras 3's `model.fit` under MultiWorkerMirroredStrategy.

Keras 3 (through at least 3.15) fails in `model.fit` under
`tf.distribute.MultiWorkerMirroredStrategy` before the first step: to build
the model's variables it averages the first batch over the workers with
`strategy.reduce`, which that strategy cannot do for a nested batch
(keras-team/keras#20585, tensorflow/tensorflow#72388); and after each step it
averages the scalar logs (the loss) with `reduce(..., axis=0)`, which fails on
a scalar. Only the shapes of that batch matter, so `fix_keras_multi_worker()`
builds from this worker's own first replica batch instead, and averages the
logs over replicas with `axis=None`. `ee.init()` applies it when there are
several workers.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["fix_keras_multi_worker"]

_applied = False


def fix_keras_multi_worker() -> None:
    """Lets `model.fit` run under MultiWorkerMirroredStrategy (idempotent)."""
    global _applied
    if _applied:
        return
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> None:
        if self._distribute_strategy is None:
            return  # Keras builds when the step function is traced
        strategy = self.distribute_strategy
        if iterator is not None:
            for _, _, it in iterator:
                data_batch = tree.map_structure(
                    lambda x: (
                        strategy.experimental_local_results(x)[0]
                        if isinstance(x, tf.distribute.DistributedValues)
                        else x
                    ),
                    next(it),
                )
                break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    keras_reduce_per_replica = trainer.reduce_per_replica

    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        if reduction in ("auto", "mean") and isinstance(
            strategy, tf.distribute.MultiWorkerMirroredStrategy
        ):
            return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return keras_reduce_per_replica(values, strategy, reduction)

    trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    trainer.reduce_per_replica = reduce_per_replica
    _applied = True
