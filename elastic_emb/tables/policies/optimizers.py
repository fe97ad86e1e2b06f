"""Sparse optimizers that run inside the table, next to the rows.

Each class mirrors the `keras.optimizers` class of the same name: the same
update formula, arguments and defaults. They are applied lazily: a push
updates only the rows it touches (see docs/optimizers.md for where that
differs from dense Keras updates).

Keras is optional here: it is only touched when given a Keras object (an
optimizer or a learning-rate schedule) or a serialized schedule, so tables
work in processes without TensorFlow/Keras.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, TypeGuard

if TYPE_CHECKING:
    import keras

__all__ = ["SGD", "Adagrad", "Adam", "Ftrl", "Optimizer", "RMSprop", "from_keras", "get"]

LearningRate: TypeAlias = "float | keras.optimizers.schedules.LearningRateSchedule"


def _loaded_keras_class(module: str, name: str) -> type | None:
    """`keras.<module>.<name>` if Keras is already imported, else None.

    An object can only be an instance of a Keras class once Keras is loaded,
    so checking needs no import (which would load TensorFlow).
    """
    keras_module = sys.modules.get("keras")
    if keras_module is None:
        return None
    obj: Any = keras_module
    for part in (*module.split("."), name):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, type) else None


def _is_schedule(value: Any) -> TypeGuard[keras.optimizers.schedules.LearningRateSchedule]:
    """Whether `value` is a `keras.optimizers.schedules.LearningRateSchedule`."""
    cls = _loaded_keras_class("optimizers.schedules", "LearningRateSchedule")
    return cls is not None and isinstance(value, cls)


def _is_keras_optimizer(value: Any) -> TypeGuard[keras.optimizers.Optimizer]:
    """Whether `value` is a `keras.optimizers.Optimizer`."""
    cls = _loaded_keras_class("optimizers", "Optimizer")
    return cls is not None and isinstance(value, cls)


def _import_keras(what: str) -> Any:
    """Imports Keras, or raises an ImportError that says what needed it."""
    try:
        import keras
    except ImportError as e:
        raise ImportError(f"{what} needs Keras (install tensorflow with Keras 3)") from e
    return keras


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """Base class of the table optimizers.

    Args:
        learning_rate: float or `keras.optimizers.schedules.LearningRateSchedule`.
            A schedule is evaluated at the table's optimizer iteration count
            before each push, as Keras does.
    """

    learning_rate: LearningRate = 0.001
    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        lr = self.learning_rate
        if not _is_schedule(lr):
            if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
                raise ValueError(
                    "`learning_rate` must be a positive float or a LearningRateSchedule. "
                    f"Received: learning_rate={lr!r}"
                )
            object.__setattr__(self, "learning_rate", float(lr))

    def constant_learning_rate(self) -> float | None:
        """The learning rate of every update, or None when a schedule sets each one."""
        lr = self.learning_rate
        return None if _is_schedule(lr) else lr

    def learning_rate_at(self, iterations: int) -> float:
        """The learning rate of the update that follows `iterations` updates."""
        lr = self.learning_rate
        if _is_schedule(lr):
            keras = _import_keras("A learning-rate schedule")
            return float(keras.ops.convert_to_numpy(lr(iterations)))
        return lr

    def core_args(self) -> dict[str, Any]:
        """Options passed to the C++ core (everything but the learning rate)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "learning_rate"
        }

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"class_name": type(self).__name__}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if _is_schedule(value):
                keras = _import_keras("Serializing a learning-rate schedule")
                value = keras.saving.serialize_keras_object(value)
            config[f.name] = value
        return config

    @staticmethod
    def from_config(config: dict[str, Any]) -> Optimizer:
        config = dict(config)
        cls = _BY_NAME[config.pop("class_name").lower()]
        lr = config.get("learning_rate")
        if isinstance(lr, dict):
            keras = _import_keras("A serialized learning-rate schedule")
            config["learning_rate"] = keras.saving.deserialize_keras_object(lr)
        return cls(**config)

    def _check_range(self, name: str, low: float, high: float, *, high_open: bool = False) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"`{name}` must be a number. Received: {name}={value!r}")
        ok = low <= value < high if high_open else low <= value <= high
        if not ok or math.isnan(value):
            bound = f"[{low}, {high})" if high_open else f"[{low}, {high}]"
            raise ValueError(f"`{name}` must be in {bound}. Received: {name}={value!r}")


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """Stochastic gradient descent with optional (lazy) momentum.

    Example:
        >>> opt = SGD(learning_rate=0.1, momentum=0.9)
    """

    learning_rate: LearningRate = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    kind: ClassVar[str] = "sgd"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_range("momentum", 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad: `acc += g²; v -= lr * g / sqrt(acc + epsilon)`."""

    learning_rate: LearningRate = 0.001
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7
    kind: ClassVar[str] = "adagrad"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_range("initial_accumulator_value", 0.0, math.inf)
        self._check_range("epsilon", 0.0, math.inf)


@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """Lazy Adam: moments of untouched rows are not decayed.

    The bias correction uses the table's iteration count (pushes so far),
    like Keras uses the optimizer's `iterations`.
    """

    learning_rate: LearningRate = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    kind: ClassVar[str] = "adam"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_range("beta_1", 0.0, 1.0, high_open=True)
        self._check_range("beta_2", 0.0, 1.0, high_open=True)
        self._check_range("epsilon", 0.0, math.inf)


@dataclasses.dataclass(frozen=True)
class Ftrl(Optimizer):
    """FTRL-Proximal with the arguments of `keras.optimizers.Ftrl`."""

    learning_rate: LearningRate = 0.001
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float = 0.0
    kind: ClassVar[str] = "ftrl"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_range("learning_rate_power", -math.inf, 0.0)
        for name in (
            "initial_accumulator_value",
            "l1_regularization_strength",
            "l2_regularization_strength",
            "l2_shrinkage_regularization_strength",
            "beta",
        ):
            self._check_range(name, 0.0, math.inf)


@dataclasses.dataclass(frozen=True)
class RMSprop(Optimizer):
    """RMSprop with the arguments of `keras.optimizers.RMSprop`:
    `v = rho v + (1 - rho) g²; w -= lr g / sqrt(v + epsilon)` (centered: minus the
    squared moving average of g; momentum: on the increments). Lazy, like Adam."""

    learning_rate: LearningRate = 0.001
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-7
    centered: bool = False
    kind: ClassVar[str] = "rmsprop"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_range("rho", 0.0, 1.0)
        self._check_range("momentum", 0.0, 1.0)
        self._check_range("epsilon", 0.0, math.inf)


_BY_NAME: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adagrad": Adagrad,
    "adam": Adam,
    "ftrl": Ftrl,
    "rmsprop": RMSprop,
}

# keras.optimizers.Optimizer arguments that have no sparse equivalent; each
# is accepted only when off (None, 0 or False).
_UNSUPPORTED_KERAS_OPTIONS = (
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "loss_scale_factor",
    "gradient_accumulation_steps",
    "amsgrad",
)


def from_keras(optimizer: keras.optimizers.Optimizer) -> Optimizer:
    """Converts a `keras.optimizers.*` instance to the table optimizer.

    Raises:
        ValueError: for an optimizer class without a sparse version, or an
            option that the table cannot honour (named in the message).
    """
    keras = _import_keras("Converting a keras.optimizers optimizer")
    name = type(optimizer).__name__
    cls = _BY_NAME.get(name.lower())
    if cls is None:
        raise ValueError(
            f"Optimizer {name} has no sparse table version; use one of "
            f"{sorted(c.__name__ for c in _BY_NAME.values())}. Received: optimizer={optimizer!r}"
        )
    config = optimizer.get_config()
    for option in _UNSUPPORTED_KERAS_OPTIONS:
        value = config.get(option)
        if value:
            raise ValueError(
                f"keras.optimizers.{name} option `{option}` is not supported by elastic_emb "
                f"tables. Received: {option}={value!r}"
            )
    # A schedule is kept as it is (Keras has no public accessor for it).
    from elastic_emb.keras_range import require

    require(
        hasattr(optimizer, "_learning_rate"), "Optimizer._learning_rate", "learning-rate schedules"
    )
    lr = optimizer._learning_rate
    if not _is_schedule(lr):
        lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    args = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config}
    args["learning_rate"] = lr
    return cls(**args)


def get(identifier: Any) -> Optimizer:
    """Resolves an optimizer given as an instance, a Keras optimizer or a name.

    Args:
        identifier: `ee.optimizers.Optimizer`, `keras.optimizers.Optimizer`,
            a name ("sgd", "adagrad", "adam", "ftrl", "rmsprop"; Keras defaults) or a config
            dict from `get_config()`.
    """
    if isinstance(identifier, Optimizer):
        return identifier
    if _is_keras_optimizer(identifier):
        return from_keras(identifier)
    if isinstance(identifier, str) and identifier.lower() in _BY_NAME:
        return _BY_NAME[identifier.lower()]()
    if isinstance(identifier, dict) and "class_name" in identifier:
        return Optimizer.from_config(identifier)
    raise ValueError(
        "`optimizer` must be an ee.optimizers instance, a keras.optimizers instance "
        f"or one of {sorted(_BY_NAME)}. Received: optimizer={identifier!r}"
    )
