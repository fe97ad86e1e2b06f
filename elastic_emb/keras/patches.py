"""Where elastic_emb reaches into Keras beyond its public extension points, each gated.

Keras is supported from `OLDEST` (what TensorFlow 2.16 installs) and tested
up to `LAST_TESTED` (docs/keras.md#supported-versions); `check_keras()`
refuses an older one at import. The layer itself uses public mechanisms
only (`build`, `call`, `compute_output_spec`, `save_own_variables`, a
variable's `overwrite_with_gradient`, the optimizer's `apply`). These are
the exceptions, each checked where it is used: a missing internal raises a
`RuntimeError` naming the Keras version and what to do (`require()`), or,
where an exact fallback exists, warns once and takes it.

- `fuse_functional_lookups()` wraps the private `Functional.call` (which
  Sequential models run too) so that a model looks up the rows of all its
  ee.Embedding layers in one call (`elastic_emb.keras.lookup.fused_call` on
  TensorFlow, `elastic_emb.keras.on_jax` on JAX, both through
  `elastic_emb.keras.model_lookups`, which reads `_nodes_by_depth`,
  `_standardize_inputs` and `_run_through_graph`; `lookahead` reads
  `Sequential._functional`). TensorFlow is imported only by the functions that
  need it, so that the JAX layer can use this module. Keras has no public hook before a model's
  layers run. Fallback: every layer looks up on its own (the same results,
  one lookup per layer).
- `after_compile()` (`elastic_emb.keras.compile_hook`, shared with the JAX
  backend) wraps `compile` where Keras defines it (the private `Trainer`, so
  `load_model` still compiles loaded models; fallback: the public
  `keras.Model.compile`): `ee.init(dense="ps")` and `mixed_float16` need the
  compiled optimizer, and Keras has no compile callback.
- `fix_keras_multi_worker()` replaces two private functions of Keras'
  TensorFlow trainer for `model.fit` under MultiWorkerMirroredStrategy
  (below; the first only where it exists, Keras 3.5 and newer); required.
- Outside this module: `elastic_emb.keras.base.embedding_layers` walks
  `Layer._flatten_layers` (the only walk that finds layers nested in other
  layers); `ee.callbacks.Checkpoint` sets `Model._initial_epoch`, as
  `keras.callbacks.BackupAndRestore` does; `ee.optimizers.from_keras` reads
  `Optimizer._learning_rate` (the schedule object itself; the public
  `learning_rate` is its current value). All are required (`require()`).

Public functions wrapped, all of them applied when `elastic_emb.keras.layers` is
imported: `keras.Model.export` (`export_through_serving()`: tables exported
as stock TensorFlow ops), `tf.saved_model.save` (`save_through_serving()`,
the same for a Keras model), `keras.Model.save` (`refuse_legacy_h5()`: the
HDF5 format, which cannot hold tables, refuses models with them),
`keras.Model.fit`, `evaluate` and `predict` (`check_data_first()`: ids of a
string or float dtype for an integer input are refused first). On every
backend, `elastic_emb.keras.weights` wraps Keras's weights by value
(`get_weights`, `set_weights`, the state tree, `count_params`) so that they
carry the tables' rows, and refuses `use_ema` and `OrbaxCheckpoint`. Per
instance: `dense_ps.attach` wraps a compiled model's `train_step`,
`test_step`, `predict_step`, `fit` and its optimizer's `apply_gradients`
(on JAX, `dense_ps_jax.attach` the same steps, `make_train_function`,
`make_test_function`, `make_predict_function`, `fit` and the optimizer's
`apply`); `loss_scaling.attach` a `LossScaleOptimizer`'s `apply`.

On JAX with 64-bit types off, `elastic_emb.keras.jax_ids.feed_halves()` wraps
`keras.Model.fit`, `evaluate`, `predict` and `*_on_batch`, the private
`trainers.data_adapters.get_data_adapter` and `Functional._convert_inputs_to_tensors`
(Keras converts a batch to JAX, and a model's inputs to their dtypes, there),
so that int64 ids reach `ee.Embedding` as 32-bit halves; both private ones
required (`require()`).

The rest of this docstring is about the multi-worker fix.

Keras 3 (through at least 3.15) fails in `model.fit` under
`tf.distribute.MultiWorkerMirroredStrategy`. From 3.5, before the first
step: to build the model's variables it averages the first batch over the workers with
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
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import keras

from elastic_emb.errors import ElasticEmbWarning
from elastic_emb.keras.compile_hook import after_compile
from elastic_emb.keras_range import LAST_TESTED, OLDEST, check_keras, keras_version, require, tested

__all__ = [
    "LAST_TESTED",
    "OLDEST",
    "after_compile",
    "check_keras",
    "export_through_serving",
    "fix_keras_multi_worker",
    "fuse_functional_lookups",
    "keras_version",
    "refuse_legacy_h5",
    "require",
    "save_through_serving",
]

_applied = False
_export_wrapped = False
_save_wrapped = False
_tf_save_wrapped = False
_call_wrapped = False
_data_checked = False


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


def save_through_serving(
    serving: Callable[[keras.Model, Any], AbstractContextManager[Any]],
) -> None:
    """Runs `tf.saved_model.save(model, export_dir, ...)` of a Keras model within
    `serving(model, export_dir)` (idempotent)."""
    global _tf_save_wrapped
    if _tf_save_wrapped:
        return
    import tensorflow as tf

    tf_save = tf.saved_model.save

    @functools.wraps(tf_save)
    def save(obj: Any, export_dir: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(obj, keras.Model):
            return tf_save(obj, export_dir, *args, **kwargs)
        with serving(obj, export_dir):
            return tf_save(obj, export_dir, *args, **kwargs)

    # Every module that holds the function (its own, which a later import of
    # `tensorflow.saved_model` reads again, and the public aliases).
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get("save") is tf_save:
            module.save = save  # type: ignore[attr-defined]
    _tf_save_wrapped = True


def check_data_first(check: Callable[[keras.Model, Any], None]) -> None:
    """Runs `check(model, x)` before `model.fit`, `evaluate` and `predict` (idempotent)."""
    global _data_checked
    if _data_checked:
        return
    for method in ("fit", "evaluate", "predict"):
        keras_method = getattr(keras.Model, method)

        setattr(keras.Model, method, _checking_data(keras_method, check))
    _data_checked = True


def _checking_data(keras_method: Any, check: Callable[[keras.Model, Any], None]) -> Any:
    @functools.wraps(keras_method)
    def checked(self: keras.Model, *args: Any, **kwargs: Any) -> Any:
        check(self, args[0] if args else kwargs.get("x"))
        return keras_method(self, *args, **kwargs)

    return checked


def fuse_functional_lookups(fused_call: Callable[..., Any]) -> None:
    """Runs `Functional.call` as `fused_call(model, inputs, training, call)` (idempotent)."""
    global _call_wrapped
    if _call_wrapped:
        return
    try:
        from keras.src.models.functional import Functional
    except ImportError:
        Functional = None
    internals = ("call", "_standardize_inputs", "_run_through_graph")
    if Functional is None or not all(hasattr(Functional, name) for name in internals):
        warnings.warn(
            f"Keras {keras.__version__} changed keras.src.models.functional.Functional "
            f"(elastic_emb was tested with Keras {tested()}): each ee.Embedding layer looks "
            "up its rows on its own (the same results, one lookup per layer)",
            ElasticEmbWarning,
            stacklevel=2,
        )
        return
    keras_call = Functional.call

    @functools.wraps(keras_call)
    def call(self: Any, inputs: Any, training: Any = None, mask: Any = None, **kwargs: Any) -> Any:
        def run() -> Any:
            return keras_call(self, inputs, training=training, mask=mask, **kwargs)

        return fused_call(self, inputs, training, run)

    Functional.call = call
    _call_wrapped = True


def fix_keras_multi_worker() -> None:
    """Lets `model.fit` run under MultiWorkerMirroredStrategy (idempotent)."""
    global _applied
    if _applied:
        return
    import tensorflow as tf
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    require(
        hasattr(trainer, "reduce_per_replica"),
        "keras.src.backend.tensorflow.trainer.reduce_per_replica",
        "model.fit under MultiWorkerMirroredStrategy",
    )
    if keras_version() > LAST_TESTED:
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

    # (The first batch averaged over the workers: Keras 3.5 and newer.)
    if hasattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build"):
        trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    trainer.reduce_per_replica = reduce_per_replica
    _applied = True
