"""Dense weights on the parameter servers, what every Keras backend shares.

`ee.init(..., dense="ps")` (async modes): a worker trains with plain
`model.fit` and no all-reduce: the model's trainable variables other than the
tables live on the PS in one more table, `ee_dense/<model name>`, each
variable flattened and cut into rows of `ROW_WIDTH` floats (keys 0, 1, ... in
the order of the variables' paths). That table's optimizer is the one given
to `model.compile`, converted with `ee.optimizers.from_keras` (SGD, Adagrad,
Adam, Ftrl, Keras formulas, learning-rate schedules evaluated at the table's
step count). The layout and the optimizer are the same on every backend, so
the table one backend trained serves the other.

Each training step:

1. pulls every row of the dense table, in the step's pull with the tables of
   the `ee.Embedding` layers, and computes with them (with
   `ee.init(dense_pull_every=k)`, only every k-th step: the others use the
   rows last pulled);
2. runs the step as Keras does (forward, loss, gradients);
3. hands the dense variables' gradients to the PS instead of the local
   optimizer, in the step's fused push: the PS applies them with the
   optimizer's formula.

Evaluation and prediction steps read the rows first (without a step), and
`fit` refreshes the variables before each epoch's callbacks and at its end,
so callbacks, `evaluate`, `predict` and `model.save` see the PS's values.
`set_weights` and `set_state_tree` (`EarlyStopping(restore_best_weights=True)`
among their callers) store the values they assign on the PS, whose optimizer
slots stay, as Keras's optimizer state does.

One worker stores its initial values in the table while it is not
complete: worker 0, or with a coordinator the first worker to train (it
holds a claim in etcd under its lease, which passes on if it dies first).
The others wait for them, so every worker starts from the same weights. A
restored table (`ee.restore`, cluster checkpoints) is used as it is.

Here: the table and its rows (`DenseOnPS`, host side) and `attach_model`, which
wraps a compiled model's `fit` and `set_weights`. How a step reaches the rows
is the backend's: `elastic_emb.keras.dense_ps` (TensorFlow: `tf.numpy_function`
in the traced step) and `elastic_emb.keras.dense_ps_jax` (JAX: ordered host
callbacks in the jitted step). Neither TensorFlow nor JAX is imported here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from elastic_emb.keras import weights
from elastic_emb.tables import registry
from elastic_emb.tables.policies import optimizers
from elastic_emb.tables.table import DENSE_TABLE_PREFIX, Table

if TYPE_CHECKING:
    from elastic_emb.ps.client.cluster import Cluster

__all__ = ["ROW_WIDTH", "DenseOnPS", "attach_model", "dense_cluster"]

ROW_WIDTH = 256  # floats per row of the dense table
# The attached models, whose `_ee_dense_write` runs after `set_weights` (`weights.on_assigned`).
_attached: weakref.WeakSet[keras.Model] = weakref.WeakSet()
_WAIT_SECONDS = 0.05


class DenseOnPS:
    """The dense table of one model and how its rows map onto the model's variables."""

    def __init__(self, model: keras.Model, cluster: Cluster, timeout: float) -> None:
        variables = [
            v
            for v in model.trainable_variables
            if not getattr(v, "ee_push_trigger", False)  # (ee.Embedding's)
        ]
        paths = [v.path for v in variables]
        if len(set(paths)) != len(paths):
            raise ValueError(
                f"dense='ps' needs unique variable paths; model {model.name!r} has duplicates "
                f"among {sorted(paths)}"
            )
        self.variables = sorted(variables, key=lambda v: v.path)
        self.sizes = [int(np.prod(v.shape)) for v in self.variables]
        self.rows = [-(-size // ROW_WIDTH) for size in self.sizes]
        self.keys = np.arange(sum(self.rows), dtype=np.int64)
        self.table = Table(
            ROW_WIDTH,
            optimizer=optimizers.from_keras(model.optimizer),
            initializer="zeros",
            name=f"{DENSE_TABLE_PREFIX}{model.name}",
        )
        self._ids = {id(v) for v in self.variables}
        self._cluster = cluster
        connected = registry.connection()
        self.pull_every = 1 if connected is None else connected.dense_pull_every
        self._steps = 0  # training steps run (for `pull_every`)
        self._last: np.ndarray | None = None  # the rows last pulled
        self._initialize(timeout)

    def _initialize(self, timeout: float) -> None:
        """Until the table holds every row: stores this worker's initial values if it is
        the one that initializes (`_initializes`), else waits."""
        deadline = time.monotonic() + timeout
        while len(self.table) < len(self.keys):
            if self._initializes():
                initial = [keras.ops.convert_to_numpy(v) for v in self.variables]
                self.table.import_rows(self.keys, self._rows_of(initial))
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.table.name!r} holds {len(self.table)} of {len(self.keys)} rows after "
                    f"{timeout:g} s, waiting for the worker that stores the initial dense "
                    "weights (worker 0; with a coordinator, the first one to train)"
                )
            time.sleep(_WAIT_SECONDS)
        self.refresh()

    def _initializes(self) -> bool:
        """Whether this worker stores the first values: worker 0 with fixed workers; with
        a coordinator, the live worker holding the table's claim (the first to ask)."""
        routing = self._cluster.routing
        if routing is None:
            return self._cluster.worker_index == 0
        return routing.claim(f"initialize/{self.table.name}")

    def _rows_of(self, values: list[Any]) -> np.ndarray:
        """The variables' values (or gradients) as the table's `(rows, ROW_WIDTH)` rows."""
        out = np.zeros((len(self.keys), ROW_WIDTH), np.float32)
        flat = out.reshape(-1)
        start = 0
        for value, size, rows in zip(values, self.sizes, self.rows, strict=True):
            flat[start : start + size] = np.asarray(value, np.float32).reshape(-1)
            start += rows * ROW_WIDTH
        return out

    def values_of(self, rows: np.ndarray) -> list[np.ndarray]:
        """The table's `(rows, ROW_WIDTH)` rows as one value per variable (its shape and
        dtype), in `self.variables`' order."""
        flat = np.asarray(rows, np.float32).reshape(-1)
        values, start = [], 0
        for variable, size, count in zip(self.variables, self.sizes, self.rows, strict=True):
            value = flat[start : start + size].reshape(variable.shape)
            values.append(value.astype(keras.backend.standardize_dtype(variable.dtype)))
            start += count * ROW_WIDTH
        return values

    def read(self) -> np.ndarray:
        """The rows on the PS once this worker's pushes so far are applied (no step)."""
        self._cluster.flush()
        return np.asarray(self.table.pull(self.keys, train=False), np.float32)

    def write(self, values: list[np.ndarray]) -> None:
        """Stores `values` (one per variable, in `self.variables`' order) on the PS, its
        optimizer's slots kept (`set_weights`: Keras's optimizer state stays too)."""
        self._cluster.flush()
        state = self.table.export_state()
        state.values = self._rows_of(values)[state.keys]  # (keys are row numbers)
        self.table.load_state(state)
        self.refresh()

    def refresh(self) -> None:
        """Assigns the variables the PS's values now (eager; no training step)."""
        self._last = self.read()
        for variable, value in zip(self.variables, self.values_of(self._last), strict=True):
            variable.assign(value)

    def step_rows(self, training: bool) -> np.ndarray:
        """Host side of a step's pull: the rows the step computes with. Training: the
        step's pull of the dense table (which counts on this step's push; every
        `pull_every`-th step, the others reuse the rows last pulled); else `read()`."""
        if not training:
            return self.read()
        fusion, keys = self.table.step_fusion(), self.keys
        due = self._steps % self.pull_every == 0 or self._last is None
        self._steps += 1
        # A step that does not pull still takes part in the fused push (no keys pulled).
        rows = fusion.collect(fusion.submit(keys if due else keys[:0], True, True))
        if due:
            self._last = rows
        if self._last is None:  # (the first step always pulls)
            raise RuntimeError("dense weights used before their first pull")
        return self._last

    def push_rows(self, rows: np.ndarray) -> None:
        """Host side of a step's push: the dense gradient `(rows, ROW_WIDTH)` into the
        step's fused push."""
        self.table.step_fusion().push_gradient(self.keys, rows, 1)

    def holds(self, variable: Any) -> bool:
        return id(variable) in self._ids


def dense_cluster(model: keras.Model) -> tuple[Cluster, bool] | None:
    """(the cluster, whether `dense="ps"` was asked for explicitly) when `ee.init(dense=
    "ps")` is in effect for compiled `model`; else None."""
    connected = registry.connection()
    if connected is None or connected.dense != "ps" or model.optimizer is None:
        return None
    return connected.cluster, connected.dense_explicit


def attach_model(
    model: keras.Model,
    cluster: Cluster,
    steps: tuple[str, ...],
    wrap: Callable[[dict[str, Any], Callable[[], DenseOnPS]], dict[str, Any]],
    made_in: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Callable[[], DenseOnPS]:
    """Routes compiled `model`'s dense weights through the PS; returns the getter of its
    `DenseOnPS` (made at its first use, inside `made_in()`).

    `steps`: the model's methods the backend wraps; `wrap(originals, dense)` returns
    them wrapped (`originals`: those methods and `fit` as Keras defined them, kept on
    the model so that compiling again wraps them once). `fit` is wrapped here: it
    refreshes the variables before each epoch's callbacks and at its end; and
    `set_weights` / `set_state_tree` store what they assign on the PS.
    """
    optimizers.from_keras(model.optimizer)  # refuses what the table cannot do, now
    originals = model.__dict__.get("_ee_dense_originals") or {
        name: getattr(model, name) for name in (*steps, "fit")
    }
    state: dict[str, DenseOnPS] = {}

    def dense() -> DenseOnPS:
        if "dense" not in state:
            with made_in():
                state["dense"] = DenseOnPS(model, cluster, cluster.timeout)
        return state["dense"]

    fit = originals["fit"]
    fit_signature = inspect.signature(fit)

    @functools.wraps(fit)
    def fit_then_refresh(*args: Any, **kwargs: Any) -> Any:
        call = fit_signature.bind_partial(*args, **kwargs)
        refresh = keras.callbacks.LambdaCallback(on_epoch_end=lambda *_: dense().refresh())
        call.arguments["callbacks"] = [refresh, *(call.arguments.get("callbacks") or [])]
        try:
            return fit(*call.args, **call.kwargs)
        finally:
            if "dense" in state:
                state["dense"].refresh()

    def write(assigned: list[Any]) -> None:
        """After `set_weights` assigned some of the model's variables: the PS takes them."""
        ids = {id(v) for v in assigned}
        if not any(id(v) in ids for v in model.trainable_variables):
            return
        values = {id(v): keras.ops.convert_to_numpy(v) for v in model.trainable_variables}
        on_ps = dense()  # (made now if no step ran yet: it reads the PS's values)
        on_ps.write([values[id(v)] for v in on_ps.variables])

    _attached.add(model)
    wrapped = {
        "_ee_dense_write": write,
        "_ee_dense_originals": originals,
        **wrap(originals, dense),
        "fit": fit_then_refresh,
    }
    for name, value in wrapped.items():
        object.__setattr__(model, name, value)
    return dense


def _write_assigned(variables: list[Any]) -> None:
    for model in list(_attached):
        model._ee_dense_write(variables)


weights.on_assigned(_write_assigned)
