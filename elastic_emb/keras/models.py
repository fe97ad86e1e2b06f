"""A Keras model's elastic_emb side: its `ee.Embedding` layers, their export, and the
hooks that make Keras's own calls (`compile`, `fit`, `export`, `save`, `Functional.call`)
work with them, installed once by `install_hooks` (from `elastic_emb.keras`).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from elastic_emb.keras import dense_ps, input_checks, lookup, loss_scaling
from elastic_emb.keras import patches as keras_patches
from elastic_emb.keras.base import embedding_layers
from elastic_emb.keras.layers import Embedding
from elastic_emb.serving import delta
from elastic_emb.serving import export as serving

__all__ = [
    "embedding_layers",
    "export_delta",
    "export_saved_model",
    "install_hooks",
    "lookahead",
]


def export_saved_model(
    model: keras.Model,
    path: Any,
    input_signature: Any = None,
    verbose: bool = False,
    row_dtype: str = "float32",
    **kwargs: Any,
) -> None:
    """Writes `model` as a SavedModel that serves with stock TensorFlow ops.

    Same as `model.export(path)`: the `serve` endpoint (and TF Serving's
    `serving_default` signature) predicts like `model.predict` (training
    False), with every table as trained now; ids never trained get their
    initial values. Keras' export takes dense inputs only; give
    `input_signature` as `tf.TypeSpec`s (e.g.
    `[tf.RaggedTensorSpec([None, None], tf.int64)]`) for ragged or sparse ones.

    Args:
        model: a built Keras model.
        path: directory to write.
        input_signature: optional list of the model inputs' specs (Keras
            InputSpecs or tf.TypeSpecs); by default the model's inputs.
        verbose: print Keras' summary of the export.
        row_dtype: how the SavedModel stores the rows: "float32" (default,
            predicts exactly like `model.predict`), "float16", "bfloat16" or
            "int8" (a float32 scale and bias per row, `ee.export_rows`);
            lookups turn them back into float32.
        **kwargs: passed to `model.export`.

    The SavedModel carries a manifest (`assets.extra/elastic_emb.json`)
    that lets `ee.export_delta` and `ee.apply_delta` write its next
    versions from the rows changed since.

    Raises:
        ValueError: an unknown `row_dtype`, or rows holding NaN or Inf with a
            compact `row_dtype`.
    """
    serving.export(
        model, embedding_layers(model), path, input_signature, verbose, row_dtype, **kwargs
    )


def lookahead(dataset: tf.data.Dataset, model: keras.Model) -> tf.data.Dataset:
    """`dataset` for `model.fit`, each batch's rows read from the PS one step ahead.

    Remote tables only (in-process tables answer at once). The input
    pipeline computes each batch's ids with the part of `model` that
    computes them, as soon as the model takes the batch before; once that
    step's gradients are pushed, the worker reads the next step's rows
    while the step ends, instead of at the start of the next step. The rows
    are the ones the step's own pull would get (a shard answers only once
    the step before is applied, sync, or has arrived, async), and a step
    whose ids are not what was announced pulls as usual: training is
    exactly as without it. Unseen ids are inserted by the step's push
    instead of its pull (a step skipped for non-finite gradients, with
    `nonfinite="skip"`, leaves them out of the table). Not under a
    `tf.distribute` strategy with several replicas (each replica pulls on
    its own; nothing is read ahead), nor with `read_from_backups`.

    Args:
        dataset: a `tf.data.Dataset` of `x`, `(x, y)` or `(x, y, sample_weight)`
            batches, as `model.fit` takes it.
        model: the Functional or Sequential model that will train on it.

    Returns:
        The same batches, with one prepared ahead.

    Raises:
        TypeError: `dataset` is not a `tf.data.Dataset`.
        ValueError: `model` computes the ids of its `ee.Embedding` calls with
            layers that have state, or is not Functional or Sequential.
    """
    return lookup.lookahead(Embedding, dataset, model)


def export_delta(model: keras.Model, path: Any, since: Any) -> dict[str, Any]:
    """Writes the changes of `model` since the exported SavedModel `since` to `path`
    (`elastic_emb.serving.delta.export_delta`, for the model's `ee.Embedding` layers)."""
    return delta.export_delta(model, embedding_layers(model), path, since)


def _serving(model: keras.Model, path: Any) -> Any:
    return serving.serving(model, embedding_layers(model), path=path)


def _after_compile(model: keras.Model) -> None:
    # With ee.init(dense="ps"), compiled models train their dense weights on the PS.
    dense_ps.attach(model)
    # Under mixed_float16, the tables train on unscaled gradients in the steps Keras applies.
    loss_scaling.attach(model, embedding_layers(model))


def _check_ids(model: keras.Model, x: Any) -> None:
    if embedding_layers(model):
        input_checks.check_ids(model, x)


_installed = False


def install_hooks() -> None:
    """Hooks elastic_emb into Keras's model methods, once (each use gated, `keras_patches`)."""
    global _installed
    if _installed:
        return
    _installed = True
    # `model.export(...)` and `tf.saved_model.save(model, ...)` write the layers'
    # tables as stock TensorFlow ops.
    keras_patches.export_through_serving(_serving)
    keras_patches.save_through_serving(_serving)
    keras_patches.after_compile(_after_compile)
    # `model.save("m.h5")` (legacy format, no rows) refuses them.
    keras_patches.refuse_legacy_h5(lambda model: bool(embedding_layers(model)))
    # String or float data for the integer inputs of a model with tables are refused.
    keras_patches.check_data_first(_check_ids)
    # A Functional model looks up the rows of all its layers in one call.
    keras_patches.fuse_functional_lookups(lambda *args: lookup.fused_call(Embedding, *args))
