"""NumPy references of the table's sparse optimizers, written from the Keras 3 formulas.

Each update function follows `update_step` of the matching class in
`keras/src/optimizers/{sgd,adagrad,adam,ftrl,rmsprop}.py`, in float32, with the same
operation order. Python-float hyperparameters are combined in float64 first and
then cast to float32, as TensorFlow does when a Python number meets a float32
tensor (e.g. `1 - self.beta_1`).

`ReferenceTable` applies them the way a table does: the gradients of equal keys
in one push are summed first (in input order), then one update per distinct key;
rows and slots of keys not in a push are left alone (lazy semantics); the step
count is the number of pushes so far, including the current one.

Nothing here imports elastic_emb: the hyperparameters and defaults are written
out from the Keras signatures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

F32 = np.float32

# Keras 3 defaults, from the signatures of keras.optimizers.*.
DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"momentum": 0.0, "nesterov": False},
    "adagrad": {"initial_accumulator_value": 0.1, "epsilon": 1e-7},
    "adam": {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
    "rmsprop": {"rho": 0.9, "momentum": 0.0, "epsilon": 1e-7, "centered": False},
    "ftrl": {
        "learning_rate_power": -0.5,
        "initial_accumulator_value": 0.1,
        "l1_regularization_strength": 0.0,
        "l2_regularization_strength": 0.0,
        "l2_shrinkage_regularization_strength": 0.0,
        "beta": 0.0,
    },
}


def _f(x: float) -> np.float32:
    return F32(x)


def _pow(x, p):
    """float32 power, correctly rounded (computed in float64), like libm's powf.

    NumPy's own float32 power may use a SIMD approximation a few ulps off, which
    FTRL's difference of powers amplifies.
    """
    return np.power(np.asarray(x, np.float64), np.float64(F32(p))).astype(F32)


# Update rules on one row. value and slots are float32 arrays updated in place;
# grad is the (already summed) float32 gradient of the row; lr a float32.


def sgd_update(value, slots, grad, lr, *, momentum, nesterov):
    """keras.optimizers.SGD.update_step."""
    lr = _f(lr)
    if momentum != 0:
        m = slots[0]
        mu = _f(momentum)
        m[...] = m * mu - grad * lr
        if nesterov:
            value += m * mu - grad * lr
        else:
            value += m
    else:
        value -= grad * lr


def adagrad_update(value, slots, grad, lr, *, initial_accumulator_value, epsilon):
    """keras.optimizers.Adagrad.update_step."""
    del initial_accumulator_value  # only the slot's starting value
    lr = _f(lr)
    acc = slots[0]
    acc += np.square(grad)
    value -= (lr * grad) / np.sqrt(acc + _f(epsilon))


def adam_update(value, slots, grad, lr, step, *, beta_1, beta_2, epsilon):
    """keras.optimizers.Adam.update_step (amsgrad=False); step = iterations + 1."""
    lr = _f(lr)
    local_step = _f(step)
    beta_1_power = _pow(_f(beta_1), local_step)
    beta_2_power = _pow(_f(beta_2), local_step)
    m, v = slots[0], slots[1]
    alpha = lr * np.sqrt(_f(1) - beta_2_power) / (_f(1) - beta_1_power)
    m += (grad - m) * _f(1 - beta_1)
    v += (np.square(grad) - v) * _f(1 - beta_2)
    value -= (m * alpha) / (np.sqrt(v) + _f(epsilon))


def ftrl_update(
    value,
    slots,
    grad,
    lr,
    *,
    learning_rate_power,
    initial_accumulator_value,
    l1_regularization_strength,
    l2_regularization_strength,
    l2_shrinkage_regularization_strength,
    beta,
):
    """keras.optimizers.Ftrl.update_step."""
    del initial_accumulator_value  # only the slot's starting value
    lr = _f(lr)
    accum, linear = slots[0], slots[1]
    neg_power = _f(-learning_rate_power)
    l2_reg = _f(l2_regularization_strength) + _f(beta) / (_f(2.0) * lr)
    grad_to_use = grad + _f(2 * l2_shrinkage_regularization_strength) * value
    new_accum = accum + np.square(grad)
    linear += grad_to_use - ((_pow(new_accum, neg_power) - _pow(accum, neg_power)) / lr) * value
    quadratic = _pow(new_accum, neg_power) / lr + _f(2) * l2_reg
    l1 = _f(l1_regularization_strength)
    linear_clipped = np.clip(linear, -l1, l1)
    value[...] = (linear_clipped - linear) / quadratic
    accum[...] = new_accum


def rmsprop_update(value, slots, grad, lr, *, rho, momentum, epsilon, centered):
    """keras.optimizers.RMSprop.update_step; slots: velocity, [momentum], [average gradient]."""
    lr = _f(lr)
    velocity = slots[0]
    velocity[...] = _f(rho) * velocity + _f(1 - rho) * np.square(grad)
    if centered:
        average = slots[2 if momentum > 0 else 1]
        average[...] = _f(rho) * average + _f(1 - rho) * grad
        denominator = velocity - np.square(average) + _f(epsilon)
    else:
        denominator = velocity + _f(epsilon)
    increment = (lr * grad) / np.sqrt(denominator)
    if momentum > 0:
        slots[1][...] = _f(momentum) * slots[1] + increment
        value -= slots[1]
    else:
        value -= increment


def num_slots(kind: str, hparams: dict[str, Any]) -> int:
    if kind == "sgd":
        return 1 if hparams["momentum"] != 0 else 0
    if kind == "rmsprop":
        return 1 + (hparams["momentum"] > 0) + bool(hparams["centered"])
    return {"adagrad": 1, "adam": 2, "ftrl": 2}[kind]


def initial_slots(kind: str, hparams: dict[str, Any], dim: int) -> np.ndarray:
    """Slot vectors of a fresh row, (num_slots, dim): Keras' optimizer-variable initializers."""
    slots = np.zeros((num_slots(kind, hparams), dim), F32)
    if kind in ("adagrad", "ftrl"):  # accumulator (Ftrl: then linear, zeros)
        slots[0] = F32(hparams["initial_accumulator_value"])
    return slots


class ReferenceTable:
    """A dict-of-rows table applying the reference updates lazily.

    Args:
        kind: "sgd", "adagrad", "adam", "ftrl" or "rmsprop".
        dim: row width.
        init: key -> float32 (dim,) initial value of an unseen row.
        **hparams: optimizer arguments other than the learning rate (Keras
            defaults for the missing ones).
    """

    def __init__(self, kind: str, dim: int, init: Callable[[int], np.ndarray], **hparams: Any):
        self.kind = kind
        self.dim = dim
        self.init = init
        self.hparams = {**DEFAULTS[kind], **hparams}
        self.values: dict[int, np.ndarray] = {}
        self.slots: dict[int, np.ndarray] = {}
        self.iterations = 0

    def _row(self, key: int) -> None:
        if key not in self.values:
            self.values[key] = np.array(self.init(key), F32).reshape(self.dim).copy()
            self.slots[key] = initial_slots(self.kind, self.hparams, self.dim)

    def pull(self, keys) -> np.ndarray:
        """Training pull: inserts unseen keys."""
        out = np.empty((len(keys), self.dim), F32)
        for i, k in enumerate(np.asarray(keys).tolist()):
            self._row(k)
            out[i] = self.values[k]
        return out

    def import_rows(self, keys, values) -> None:
        """Sets values and resets slots (the last of equal keys wins)."""
        for k, v in zip(np.asarray(keys).tolist(), np.asarray(values, F32), strict=True):
            self.values[k] = v.copy()
            self.slots[k] = initial_slots(self.kind, self.hparams, self.dim)

    def push(self, keys, grads, lr: float) -> None:
        """One optimizer step with learning rate `lr`."""
        keys = np.asarray(keys).tolist()
        grads = np.asarray(grads, F32)
        self.iterations += 1
        step = self.iterations
        summed: dict[int, np.ndarray] = {}
        for k, g in zip(keys, grads, strict=True):  # input order, float32 sums
            if k in summed:
                summed[k] = summed[k] + g
            else:
                summed[k] = g.copy()
        h = self.hparams
        for k, g in summed.items():
            self._row(k)
            value, slots = self.values[k], self.slots[k]
            if self.kind == "sgd":
                sgd_update(value, slots, g, lr, momentum=h["momentum"], nesterov=h["nesterov"])
            elif self.kind == "adagrad":
                adagrad_update(value, slots, g, lr, **h)
            elif self.kind == "adam":
                adam_update(value, slots, g, lr, step, **h)
            elif self.kind == "ftrl":
                ftrl_update(value, slots, g, lr, **h)
            elif self.kind == "rmsprop":
                rmsprop_update(value, slots, g, lr, **h)
            else:  # pragma: no cover
                raise ValueError(self.kind)

    def rows(self, keys) -> tuple[np.ndarray, np.ndarray]:
        """(values (n, dim), slots (n, num_slots * dim)) of existing keys."""
        keys = np.asarray(keys).tolist()
        values = np.stack([self.values[k] for k in keys]) if keys else np.zeros((0, self.dim), F32)
        ns = num_slots(self.kind, self.hparams)
        slots = (
            np.stack([self.slots[k].reshape(-1) for k in keys])
            if keys
            else np.zeros((0, ns * self.dim), F32)
        )
        return values, slots
