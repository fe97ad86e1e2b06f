"""Keras's weights by value carry the tables' rows: `get_weights`/`set_weights` and the state tree.

An `ee.Embedding` has one Keras variable, its push trigger (one zero float),
where Keras's weight lists have a place for the layer. What Keras hands out
for that place is a `TableRows`: the variable's value, carrying a copy of
the table (rows, optimizer slots, row metadata, step count), as a stock
Embedding's place carries its matrix. Handing it back puts the table back:
`set_weights(get_weights())` restores rows and dense weights of one moment
together, so `EarlyStopping(restore_best_weights=True)`, twins
(`clone.set_weights(model.get_weights())`) and tuners move rows with the
dense weights. A value without rows at a table's place (a plain array, the
result of arithmetic on weights, a copy through a library that keeps plain
arrays only) is refused with an error naming the API, before anything is
assigned.

Keras's public methods wrapped here, on every backend, when `elastic_emb.keras.base`
is imported: `Layer.get_weights`, `Layer.set_weights` (which models inherit),
`Layer.count_params` (a model counts its tables' values, as each layer's own count does),
`Model.get_state_tree`, `Model.set_state_tree` (Keras 3.6+), `Model.fit`
(a compile optimizer with `use_ema` is refused: it would average the dense
weights and not the rows) and `callbacks.OrbaxCheckpoint.set_model` (Keras
3.13+: it writes variables' values only, so it refuses models with tables).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from elastic_emb.persistence import checkpoint
from elastic_emb.tables.table import TableState

__all__ = ["TableRows", "carry_rows", "on_assigned"]

_wrapped = False
# `elastic_emb.keras.base.embedding_layers`, handed over by `carry_rows`.
_embedding_layers: Callable[[Any], list[Any]] = lambda model: []  # noqa: E731
# Run with the variables `set_weights` / `set_state_tree` assigned (`on_assigned`).
_assigned_hooks: list[Callable[[list[Any]], None]] = []


def on_assigned(hook: Callable[[list[Any]], None]) -> None:
    """Runs `hook(variables)` after `set_weights` or `set_state_tree` assigned them (for
    `ee.init(dense="ps")`, whose variables' values live on the PS)."""
    if hook not in _assigned_hooks:
        _assigned_hooks.append(hook)


def _assigned(variables: list[Any]) -> None:
    for hook in _assigned_hooks:
        hook(variables)


@dataclasses.dataclass(frozen=True)
class Rows:
    """A copy of one table: its configuration (as saved) and its whole state."""

    table: str
    config: dict[str, Any]
    state: TableState

    @property
    def nbytes(self) -> int:
        s = self.state
        arrays = (s.keys, s.values, s.slots, s.last_step, s.update_count, s.counts)
        return sum(a.nbytes for a in arrays if a is not None)


class TableRows(np.ndarray):
    """The value `get_weights()` gives at an `ee.Embedding`'s place: the layer's one Keras
    variable, carrying a copy of its table (`.rows`) that `set_weights` puts back.

    Copies made with `.copy()`, `copy.copy`, `copy.deepcopy` and `pickle` keep the
    rows (shared, never modified); arrays derived by NumPy (arithmetic, `np.array`,
    `np.copy`, `np.zeros_like`) do not: they are values, not the table.
    """

    rows: Rows | None

    def __new__(cls, value: Any, rows: Rows | None) -> TableRows:
        array = np.asarray(value).view(cls)
        array.rows = rows
        return array

    def __array_finalize__(self, obj: Any) -> None:
        self.rows = None  # derived arrays are values only

    def copy(self, order: Any = "C") -> TableRows:
        return TableRows(np.asarray(self).copy(order), self.rows)

    def __copy__(self) -> TableRows:
        return self.copy()

    def __deepcopy__(self, memo: Any) -> TableRows:
        return self.copy()

    def __reduce__(self) -> Any:
        return (TableRows, (np.asarray(self), self.rows))


def copy_rows(layer: Any, api: str) -> Rows:
    """A copy of `layer`'s table for `api` (raises above the Keras size limit)."""
    table = layer.table
    layer.check_keras_size(api)
    config = {**table.config(), "num_slots": table.num_slots}
    return Rows(table.name, json.loads(json.dumps(config)), table.export_state())


def rows_to_load(layer: Any, value: Any, api: str) -> Rows:
    """The rows `value` carries for `layer`, checked to fit its table; else ValueError."""
    rows = value.rows if isinstance(value, TableRows) else None
    if rows is None:
        shape = np.shape(value)
        hint = (
            " To import pretrained vectors, pass `weights=matrix` to ee.Embedding or call "
            "layer.table.import_rows(np.arange(n), matrix)."
            if len(shape) == 2 and shape[1] == layer.output_dim
            else ""
        )
        raise ValueError(
            f"{api} got no table rows for ee.Embedding {layer.name!r}: the value at its place "
            f"(shape {shape}) is not one that get_weights() or get_state_tree() returned. The "
            "table's rows travel in that value itself; NumPy arithmetic, np.array/np.copy and "
            "libraries that keep plain arrays drop them (its .copy(), copy.deepcopy and pickle "
            "keep them). Pass the value Keras returned, or move rows with model.save, "
            f"save_weights or ee.save.{hint}"
        )
    checkpoint.check_fits(layer.table, rows.config, f"the rows given to {api}")
    return rows


def _layers_at(model: Any) -> list[Any]:
    """The built ee.Embedding layers of `model` (itself included)."""
    if not hasattr(model, "_flatten_layers"):
        return []
    return [layer for layer in _embedding_layers(model) if layer.built]


def _places(model: Any, variables: list[Any]) -> Iterator[tuple[Any, int]]:
    """(layer, index in `variables` of its push trigger) for each ee.Embedding of `model`."""
    index = {id(v): i for i, v in enumerate(variables)}
    for layer in _layers_at(model):
        i = index.get(id(layer.push_trigger))
        if i is not None:
            yield layer, i


def _path_in(tree: Any, path: str) -> tuple[dict[str, Any], str] | None:
    """(the dict holding the leaf at `path` of a state tree, its key), or None."""
    *parents, leaf = path.split("/")
    for part in parents:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return (tree, leaf) if isinstance(tree, dict) and leaf in tree else None


def _state_places(model: Any, tree: Any) -> Iterator[tuple[Any, dict[str, Any], str]]:
    """(layer, dict, key) of each ee.Embedding's push trigger in a state tree."""
    if not isinstance(tree, dict):
        return
    for layer in _layers_at(model):
        for group in ("trainable_variables", "non_trainable_variables"):
            found = _path_in(tree.get(group), layer.push_trigger.path)
            if found is not None:
                yield layer, *found


def carry_rows(embedding_layers: Callable[[Any], list[Any]]) -> None:
    """Wraps Keras's weight APIs so that they carry the rows of the tables of the layers
    `embedding_layers(model)` finds (idempotent)."""
    global _wrapped, _embedding_layers
    if _wrapped:
        return
    _embedding_layers = embedding_layers
    layer_class = keras.layers.Layer
    keras_get, keras_set = layer_class.get_weights, layer_class.set_weights

    @functools.wraps(keras_get)
    def get_weights(self: Any) -> list[Any]:
        weights = keras_get(self)
        for layer, i in _places(self, self.weights):
            weights[i] = TableRows(weights[i], copy_rows(layer, "get_weights()"))
        return weights

    @functools.wraps(keras_set)
    def set_weights(self: Any, weights: Any) -> None:
        variables = self.weights
        loads = []
        if len(weights) == len(variables):  # (else Keras raises)
            for layer, i in _places(self, variables):
                loads.append((layer, rows_to_load(layer, weights[i], "set_weights()")))
        keras_set(self, weights)
        for layer, rows in loads:
            layer.table.load_state(rows.state)
        _assigned(variables)

    layer_class.get_weights, layer_class.set_weights = get_weights, set_weights
    _count_table_values(layer_class)
    if hasattr(keras.Model, "get_state_tree"):  # Keras 3.6+
        _carry_rows_in_state_trees()
    _refuse_moving_averages()
    orbax = getattr(keras.callbacks, "OrbaxCheckpoint", None)
    if orbax is not None:
        _refuse_value_only_checkpoints(orbax)
    _wrapped = True


def _count_table_values(layer_class: Any) -> None:
    """A model's `count_params()` counts its tables' values (rows × width), as each
    ee.Embedding's own does, in place of their one-float push triggers."""
    keras_count = layer_class.count_params

    @functools.wraps(keras_count)
    def count_params(self: Any) -> int:
        total = keras_count(self)
        for layer in _layers_at(self):
            if layer is not self:
                total += layer.count_params() - int(np.prod(layer.push_trigger.shape))
        return total

    layer_class.count_params = count_params


def _carry_rows_in_state_trees() -> None:
    keras_get, keras_set = keras.Model.get_state_tree, keras.Model.set_state_tree

    @functools.wraps(keras_get)
    def get_state_tree(self: Any, *args: Any, **kwargs: Any) -> Any:
        tree = keras_get(self, *args, **kwargs)
        for layer, parent, key in _state_places(self, tree):
            parent[key] = TableRows(
                keras.ops.convert_to_numpy(parent[key]), copy_rows(layer, "get_state_tree()")
            )
        return tree

    @functools.wraps(keras_set)
    def set_state_tree(self: Any, state_tree: Any) -> None:
        loads = [
            (layer, rows_to_load(layer, parent[key], "set_state_tree()"))
            for layer, parent, key in _state_places(self, state_tree)
        ]
        keras_set(self, state_tree)
        for layer, rows in loads:
            layer.table.load_state(rows.state)
        _assigned(self.variables)

    keras.Model.get_state_tree, keras.Model.set_state_tree = get_state_tree, set_state_tree


def _refuse_moving_averages() -> None:
    """`fit` refuses a model with tables whose compile optimizer keeps an EMA of the
    weights (`use_ema=True`): at its end it would set the dense weights to their average
    and leave the rows as they are."""
    keras_fit = keras.Model.fit

    @functools.wraps(keras_fit)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = getattr(self, "optimizer", None)
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if getattr(inner, "use_ema", False) and _layers_at(self):
            raise ValueError(
                "The compile optimizer has use_ema=True: at the end of fit Keras would set the "
                "dense weights to their moving average, while the ee.Embedding tables keep "
                "their rows (a table keeps no average). Compile without use_ema."
            )
        return keras_fit(self, *args, **kwargs)

    keras.Model.fit = fit


def _refuse_value_only_checkpoints(callback_class: Any) -> None:
    keras_set_model = callback_class.set_model

    @functools.wraps(keras_set_model)
    def set_model(self: Any, model: Any) -> None:
        if _layers_at(model):
            raise ValueError(
                f"keras.callbacks.{callback_class.__name__} writes the values of the model's "
                "variables, not the rows of its ee.Embedding tables. Use "
                "keras.callbacks.ModelCheckpoint or ee.callbacks.Checkpoint, which save them."
            )
        keras_set_model(self, model)

    callback_class.set_model = set_model
