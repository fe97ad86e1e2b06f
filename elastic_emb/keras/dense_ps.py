"""Dense weights on the parameter servers: `ee.init(..., dense="ps")` (async modes).

A worker then trains with plain `model.fit` and no all-reduce: the model's
trainable variables other than the tables live on the PS in one more table,
`ee_dense/<model name>`, each variable flattened and cut into rows of
`ROW_WIDTH` floats (keys 0, 1, ... in the order of the variables' paths).
That table's optimizer is the one given to `model.compile`, converted with
`ee.optimizers.from_keras` (SGD, Adagrad, Adam, Ftrl, Keras formulas,
learning-rate schedules evaluated at the table's step count).

Each training step (the model's `train_step`, wrapped):

1. pulls every row of the dense table, in the step's fused pull with the
   tables of the `ee.Embedding` layers, and assigns the variables (with
   `ee.init(dense_pull_every=k)`, only every k-th step: the others assign
   the rows last pulled);
2. runs the step as Keras does (forward, loss, gradients);
3. hands the dense variables' gradients to the PS instead of the local
   optimizer (`optimizer.apply_gradients`, wrapped), in the step's fused
   push: the PS applies them with the optimizer's formula.

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
"""

from __future__ import annotations

import functools
import inspect
import time
import weakref
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

from elastic_emb.keras import weights
from elastic_emb.tables import registry
from elastic_emb.tables.policies import optimizers
from elastic_emb.tables.table import DENSE_TABLE_PREFIX, Table

if TYPE_CHECKING:
    from elastic_emb.ps.client.cluster import Cluster

__all__ = ["ROW_WIDTH", "DenseOnPS", "attach"]

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

    def _rows_of(self, values: list[np.ndarray]) -> np.ndarray:
        """The variables' values (or gradients) as the table's `(rows, ROW_WIDTH)` rows."""
        out = np.zeros((len(self.keys), ROW_WIDTH), np.float32)
        flat = out.reshape(-1)
        start = 0
        for value, size, rows in zip(values, self.sizes, self.rows, strict=True):
            flat[start : start + size] = np.asarray(value, np.float32).reshape(-1)
            start += rows * ROW_WIDTH
        return out

    def _assign(self, rows: tf.Tensor) -> None:
        flat = tf.reshape(rows, [-1])
        start = 0
        for variable, size, count in zip(self.variables, self.sizes, self.rows, strict=True):
            variable.assign(tf.reshape(flat[start : start + size], variable.shape))
            start += count * ROW_WIDTH

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
        self._assign(tf.constant(self._last))

    def pull(self, training: bool) -> None:
        """In a traced step: assigns the variables the rows of this step (training: in the
        step's fused pull, which counts on this step's push)."""
        if not len(self.keys):  # a model of tables only
            return
        fusion, keys = self.table.step_fusion(), self.keys

        def read() -> np.ndarray:
            if not training:
                return self.read()
            due = self._steps % self.pull_every == 0 or self._last is None
            self._steps += 1
            # A step that does not pull still takes part in the fused push (no keys pulled).
            rows = fusion.collect(fusion.submit(keys if due else keys[:0], True, True))
            if due:
                self._last = rows
            if self._last is None:  # (the first step always pulls)
                raise RuntimeError("dense weights used before their first pull")
            return self._last

        rows = tf.numpy_function(read, [], tf.float32, stateful=True)
        self._assign(tf.reshape(rows, [len(keys), ROW_WIDTH]))

    def push(self, grads_and_vars: list[tuple[Any, Any]]) -> tf.Tensor:
        """In a traced step: sends the dense variables' gradients (a variable without one
        gets zeros) into the step's fused push; returns the op's output."""
        if not len(self.keys):
            return tf.zeros([1])
        grads = {id(v): g for g, v in grads_and_vars if g is not None}
        parts = []
        for variable, size, count in zip(self.variables, self.sizes, self.rows, strict=True):
            grad = grads.get(id(variable))
            flat = tf.zeros([size]) if grad is None else tf.reshape(tf.cast(grad, tf.float32), [-1])
            parts.append(tf.pad(flat, [[0, count * ROW_WIDTH - size]]))
        rows = tf.reshape(tf.concat(parts, 0), [len(self.keys), ROW_WIDTH])
        fusion, keys = self.table.step_fusion(), self.keys

        def send(rows: np.ndarray) -> np.ndarray:
            fusion.push_gradient(keys, rows, 1)
            return np.zeros((1,), np.float32)

        return tf.numpy_function(send, [rows], tf.float32, stateful=True)

    def holds(self, variable: Any) -> bool:
        return id(variable) in self._ids


def attach(model: keras.Model) -> None:
    """After `model.compile`: routes the model's dense weights through the PS when
    `ee.init(dense="ps")` is in effect (else does nothing). Compiling again re-attaches
    (to the new optimizer) without wrapping twice."""
    connected = registry.connection()
    if connected is None or connected.dense != "ps" or model.optimizer is None:
        return
    cluster, chosen = connected.cluster, connected.dense_explicit
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync > 1:
        if not chosen:  # the default: a strategy's all-reduce keeps them, as before
            return
        raise ValueError(
            f"dense='ps' trains dense weights without a tf.distribute strategy; model "
            f"{model.name!r} was built under {type(strategy).__name__} with "
            f"{strategy.num_replicas_in_sync} replicas. Build it outside the strategy's scope, "
            "or pass dense='local'."
        )
    optimizers.from_keras(model.optimizer)  # refuses what the table cannot do, now
    originals = model.__dict__.get("_ee_dense_originals") or {
        name: getattr(model, name) for name in ("train_step", "test_step", "predict_step", "fit")
    }
    state: dict[str, DenseOnPS] = {}

    def dense() -> DenseOnPS:
        if "dense" not in state:
            with tf.init_scope():  # (first called while a step is traced: run it now)
                state["dense"] = DenseOnPS(model, cluster, cluster.timeout)
        return state["dense"]

    def stepped(step: Any, training: bool) -> Any:
        @functools.wraps(step)
        def run(data: Any) -> Any:
            dense().pull(training)
            return step(data)

        return run

    optimizer = model.optimizer
    apply_gradients = optimizer.apply_gradients

    @functools.wraps(apply_gradients)
    def apply_gradients_on_ps(grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        on_ps = dense()
        pushed = on_ps.push([(g, v) for g, v in pairs if on_ps.holds(v)])
        with tf.control_dependencies([pushed]):
            rest = [(g, v) for g, v in pairs if not on_ps.holds(v)]
            return apply_gradients(rest, *args, **kwargs) if rest else optimizer.iterations

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
    for name, value in (
        ("_ee_dense_write", write),
        ("_ee_dense_originals", originals),
        ("train_step", stepped(originals["train_step"], True)),
        ("test_step", stepped(originals["test_step"], False)),
        ("predict_step", stepped(originals["predict_step"], False)),
        ("fit", fit_then_refresh),
    ):
        object.__setattr__(model, name, value)
    object.__setattr__(optimizer, "apply_gradients", apply_gradients_on_ps)


def _write_assigned(variables: list[Any]) -> None:
    for model in list(_attached):
        model._ee_dense_write(variables)


weights.on_assigned(_write_assigned)
