"""The places where elastic_emb changes Keras' own code, each guarded.

- `export_through_serving()` wraps the public `keras.Model.export` so that
  the tables of ee.Embedding layers are exported as stock TensorFlow ops
  (`elastic_emb.serving`); models without such layers export as before.
  Applied when `elastic_emb.layers` is imported.
- `refuse_legacy_h5()` wraps `keras.Model.save` so that the legacy HDF5
  format (`.h5`, which stores `layer.weights` only) refuses models with
  tables instead of writing a file without their rows.
- `route_dense_weights()` wraps `compile` (of Keras' private `Trainer`, where
  it is defined, so `load_model` still compiles) so that,
  with `ee.init(dense="ps")`, a compiled model's dense weights train on the
  PS (`elastic_emb.dense_ps`); otherwise compile is unchanged.
- `fuse_functional_lookups()` wraps the private `Functional.call` (which
  Sequential models run too) so that a model looks up the rows of all its
  ee.Embedding layers in one call (`elastic_emb.lookup.fused_call`). Where
  that internal is missing (another Keras), every layer looks up on its own.
- `fix_keras_multi_worker()` replaces two private functions of Keras'
  TensorFlow trainer for `model.fit` under MultiWorkerMirroredStrategy. It
  checks the Keras version it patches (Keras 3.0 through `LAST_TESTED`; newer
  releases are patched if the two internals are still there, with a warning).

The rest of this docstring is about the multi-worker fix.

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

import functools
import inspect
import re
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import keras
import tensorflow as tf

from elastic_emb.errors import ElasticEmbWarning

__all__ = [
    "LAST_TESTED",
    "export_through_serving",
    "fix_keras_multi_worker",
    "fuse_functional_lookups",
    "refuse_legacy_h5",
    "route_dense_weights",
]

LAST_TESTED = (3, 15)  # the newest Keras release this patch was tested with
_applied = False
_export_wrapped = False
_save_wrapped = False
_call_wrapped = False
_compile_wrapped = False


def refuse_legacy_h5(has_tables: Callable[[keras.Model], bool]) -> None:
    """`model.save("m.h5")` raises for models with tables (idempotent)."""
    global _save_wrapped
    if _save_wrapped:
        return
    keras_save = keras.Model.save

    @functools.wraps(keras_save)
    def save(self: keras.Model, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        if str(filepath).endswith((".h5", ".hdf5")) and has_tables(self):
            raise ValueError(
                f"{filepath}: Keras's legacy HDF5 format stores layer weights only, not the rows "
                "of elastic_emb tables. Save to a .keras file (model.save('m.keras')), which "
                "holds them."
            )
        return keras_save(self, filepath, *args, **kwargs)

    keras.Model.save = save
    _save_wrapped = True


def export_through_serving(
    serving: Callable[[keras.Model, Any], AbstractContextManager[Any]],
) -> None:
    """Runs `model.export(filepath, format, ...)` within `serving(model, path)`, path the
    SavedModel directory (None for other formats) (idempotent)."""
    global _export_wrapped
    if _export_wrapped:
        return
    keras_export = keras.Model.export
    signature = inspect.signature(keras_export)

    @functools.wraps(keras_export)
    def export(self: keras.Model, *args: Any, **kwargs: Any) -> Any:
        call = signature.bind_partial(self, *args, **kwargs).arguments
        format = call.get("format", signature.parameters["format"].default)
        with serving(self, call.get("filepath") if format == "tf_saved_model" else None):
            return keras_export(self, *args, **kwargs)

    keras.Model.export = export
    _export_wrapped = True


def route_dense_weights(attach: Callable[[keras.Model], None]) -> None:
    """Runs `attach(model)` after every `model.compile(...)` (idempotent).

    Patched where Keras defines `compile` (its `Trainer`), so that
    `load_model` still sees the stock method and compiles loaded models.
    """
    global _compile_wrapped
    if _compile_wrapped:
        return
    try:
        from keras.src.trainers.trainer import Trainer as owner
    except ImportError:  # another Keras layout: the public class
        owner = keras.Model
    keras_compile = owner.compile

    @functools.wraps(keras_compile)
    def compile(self: keras.Model, *args: Any, **kwargs: Any) -> Any:
        result = keras_compile(self, *args, **kwargs)
        attach(self)
        return result

    owner.compile = compile
    _compile_wrapped = True


def fuse_functional_lookups(fused_call: Callable[..., Any]) -> None:
    """Runs `Functional.call` as `fused_call(model, inputs, training, call)` (idempotent)."""
    global _call_wrapped
    try:
        from keras.src.models.functional import Functional
    except ImportError:
        return
    if _call_wrapped:
        return
    keras_call = Functional.call

    @functools.wraps(keras_call)
    def call(self: Any, inputs: Any, training: Any = None, mask: Any = None, **kwargs: Any) -> Any:
        def run() -> Any:
            return keras_call(self, inputs, training=training, mask=mask, **kwargs)

        return fused_call(self, inputs, training, run)

    Functional.call = call
    _call_wrapped = True


def keras_version() -> tuple[int, int]:
    """(major, minor) of the Keras imported."""
    match = re.match(r"(\d+)\.(\d+)", keras.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def fix_keras_multi_worker() -> None:
    """Lets `model.fit` run under MultiWorkerMirroredStrategy (idempotent)."""
    global _applied
    if _applied:
        return
    version = keras_version()
    if version[0] != 3:
        raise RuntimeError(
            f"elastic_emb's multi-worker patch supports Keras 3; this is Keras {keras.__version__}"
        )
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    if not (
        hasattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build")
        and hasattr(trainer, "reduce_per_replica")
    ):
        raise RuntimeError(
            f"Keras {keras.__version__} changed the internals elastic_emb patches for "
            "MultiWorkerMirroredStrategy (TensorFlowTrainer._maybe_symbolic_build, "
            "reduce_per_replica); use Keras <= "
            f"{LAST_TESTED[0]}.{LAST_TESTED[1]} or an elastic_emb release that supports it"
        )
    if version > LAST_TESTED:
        warnings.warn(
            f"Keras {keras.__version__} is newer than the last Keras elastic_emb's "
            f"multi-worker patch was tested with ({LAST_TESTED[0]}.{LAST_TESTED[1]})",
            ElasticEmbWarning,
            stacklevel=2,
        )

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
