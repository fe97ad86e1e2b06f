"""`after_compile`: runs a function after every `model.compile(...)`, on every Keras backend.

Keras has no compile callback, and `ee.init(dense="ps")` and `mixed_float16` need the
compiled optimizer. This is the one use of a Keras internal outside
`elastic_emb.keras.patches` (listed there): Keras's private `Trainer`, which defines
`compile`; without it, the public `keras.Model.compile`. Imports neither TensorFlow
nor JAX.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras

__all__ = ["after_compile"]

_compile_wrapped = False


def after_compile(attach: Callable[[keras.Model], None]) -> None:
    """Runs `attach(model)` after every `model.compile(...)` (idempotent: the first
    `attach` given stays; a process runs one Keras backend).

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
