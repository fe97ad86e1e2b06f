"""Maps Keras initializers to the table's deterministic initializers.

A table draws a row's initial value from the same distribution as the Keras
initializer, but as a pure function of (table seed, key) rather than from a
random stream, so any process computes the same value for the same key.

Keras is optional: the names below resolve without it; it is only imported
for Keras objects, config dicts and other names (to resolve or reject them
as Keras does).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    import keras

__all__ = ["InitializerSpec", "get"]

# Keras names (and aliases) -> core kind.
_KINDS = {
    "zeros": "zeros",
    "ones": "ones",
    "constant": "constant",
    "uniform": "uniform",
    "random_uniform": "uniform",
    "randomuniform": "uniform",
    "normal": "normal",
    "random_normal": "normal",
    "randomnormal": "normal",
    "truncated_normal": "truncated_normal",
    "truncatednormal": "truncated_normal",
}


# The names `keras.initializers.get` resolves to a supported initializer, with
# the Keras defaults (case-sensitive, as in Keras); "constant" is special-cased.
_KERAS_NAMES = {
    "zeros": ("zeros", 0.0, 0.0),
    "zero": ("zeros", 0.0, 0.0),
    "Zeros": ("zeros", 0.0, 0.0),
    "ones": ("ones", 0.0, 0.0),
    "one": ("ones", 0.0, 0.0),
    "Ones": ("ones", 0.0, 0.0),
    "uniform": ("uniform", -0.05, 0.05),
    "random_uniform": ("uniform", -0.05, 0.05),
    "RandomUniform": ("uniform", -0.05, 0.05),
    "normal": ("normal", 0.0, 0.05),
    "random_normal": ("normal", 0.0, 0.05),
    "RandomNormal": ("normal", 0.0, 0.05),
    "truncated_normal": ("truncated_normal", 0.0, 0.05),
    "TruncatedNormal": ("truncated_normal", 0.0, 0.05),
}


@dataclasses.dataclass(frozen=True)
class InitializerSpec:
    """A core initializer: `kind` with parameters `a`, `b`.

    uniform: a=minval, b=maxval; normal and truncated_normal: a=mean,
    b=stddev; constant: a=value. Defaults are those of Keras.
    """

    kind: str
    a: float = 0.0
    b: float = 0.0

    def to_keras(self) -> keras.initializers.Initializer:
        """The Keras initializer with the same distribution."""
        import keras

        if self.kind == "uniform":
            return keras.initializers.RandomUniform(self.a, self.b)
        if self.kind == "normal":
            return keras.initializers.RandomNormal(self.a, self.b)
        if self.kind == "truncated_normal":
            return keras.initializers.TruncatedNormal(self.a, self.b)
        if self.kind == "constant":
            return keras.initializers.Constant(self.a)
        return keras.initializers.get(self.kind)


def _is_keras_initializer(value: Any) -> TypeGuard[keras.initializers.Initializer]:
    """Whether `value` is a `keras.initializers.Initializer` (never imports Keras:
    an object can only be one once Keras is loaded)."""
    keras_module = sys.modules.get("keras")
    cls = getattr(getattr(keras_module, "initializers", None), "Initializer", None)
    return isinstance(cls, type) and isinstance(value, cls)


# Keras's TruncatedNormal stddev correction in VarianceScaling (truncation at 2 stddev).
_TRUNCATION_CORRECTION = 0.87962566103423978


def _variance_scaling(initializer: Any, shape: tuple[int, int]) -> InitializerSpec:
    """The distribution a `keras.initializers.VarianceScaling` draws for a `shape` matrix."""
    fan_in, fan_out = shape
    n = {"fan_in": fan_in, "fan_out": fan_out}.get(initializer.mode, (fan_in + fan_out) / 2.0)
    scale = float(initializer.scale) / max(1.0, float(n))
    distribution = initializer.distribution
    if distribution == "truncated_normal":
        return InitializerSpec("truncated_normal", 0.0, math.sqrt(scale) / _TRUNCATION_CORRECTION)
    if distribution == "untruncated_normal":
        return InitializerSpec("normal", 0.0, math.sqrt(scale))
    limit = math.sqrt(3.0 * scale)
    return InitializerSpec("uniform", -limit, limit)


def get(identifier: Any, shape: tuple[int, int] | None = None) -> InitializerSpec:
    """Resolves a Keras initializer name or object.

    `shape` (vocabulary size, width), when known, lets `VarianceScaling` and
    its subclasses (GlorotUniform, HeNormal, LecunNormal, ...) resolve to the
    distribution Keras would draw from for a table of that shape.

    Raises:
        ValueError: for an initializer without a deterministic table version.
    """
    obj = identifier
    if isinstance(identifier, InitializerSpec):
        return identifier
    if isinstance(identifier, str) and identifier.lower() == "constant":
        return InitializerSpec("constant", 0.0)  # keras.initializers.Constant()'s default
    if isinstance(identifier, str) and identifier in _KERAS_NAMES:
        return InitializerSpec(*_KERAS_NAMES[identifier])
    if isinstance(identifier, str | dict):
        try:
            import keras

            obj = keras.initializers.get(identifier)
        except (ImportError, ValueError, KeyError, TypeError):
            obj = None
    if _is_keras_initializer(obj):
        kind = _KINDS.get(type(obj).__name__.lower())
        config = obj.get_config()
        if all(hasattr(obj, a) for a in ("scale", "mode", "distribution")):  # VarianceScaling
            if shape is None:
                raise ValueError(
                    f"`embeddings_initializer` {type(obj).__name__} scales with the vocabulary "
                    "size, which a table without a vocabulary does not have: pass "
                    "`input_dim` (or use uniform, normal or truncated_normal). "
                    f"Received: embeddings_initializer={identifier!r}"
                )
            return _variance_scaling(obj, shape)
        if kind == "uniform":
            return InitializerSpec(kind, float(config["minval"]), float(config["maxval"]))
        if kind in ("normal", "truncated_normal"):
            return InitializerSpec(kind, float(config["mean"]), float(config["stddev"]))
        if kind == "constant":
            value = config["value"]
            if isinstance(value, int | float):
                return InitializerSpec(kind, float(value))
        elif kind in ("zeros", "ones"):
            return InitializerSpec(kind)
    raise ValueError(
        "`embeddings_initializer` must be one of zeros, ones, constant (scalar), uniform, "
        f"normal, truncated_normal (name or keras.initializers object). "
        f"Received: embeddings_initializer={identifier!r}"
    )
