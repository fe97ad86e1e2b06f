"""int64 ids on Keras's JAX backend with 64-bit types off (`JAX_ENABLE_X64` unset).

JAX then holds no int64 array: it cuts int64 data to int32 as it enters a jitted
step, silently. So the ids of a model's `ee.Embedding` inputs travel as their two
32-bit halves instead, and are joined again on the host, in the layer's callbacks:

- `feed_halves()` wraps `fit`, `evaluate`, `predict` and `*_on_batch`: there each
  batch of a Functional (or Sequential) model's inputs that only `ee.Embedding`
  layers read, declared int64, is split into halves, uint32 `(*shape, 2)` (a view),
  before Keras converts the batch. A subclassed model (which inputs reach which
  layers is unknown before it runs) gets each 64-bit integer input as `SplitIds`,
  which JAX carries as its halves and which refuses to become a JAX array.
- `Functional._convert_inputs_to_tensors` (wrapped, where Keras converts a model's
  inputs to its `Input` dtypes, which would cast the halves) hands such an input to
  the layers as `SplitIds`, and splits NumPy int64 ids given to `model(x)` itself.
- The layer (`elastic_emb.keras.on_jax`) looks rows up by the joined keys.

With 64-bit types on nothing here acts. Neither TensorFlow nor the layer is imported.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import jax
import keras
import numpy as np

from elastic_emb.keras.base import FLOAT_MANTISSA_BITS, EmbeddingBase
from elastic_emb.keras_range import require

__all__ = ["SplitIds", "as_split_ids", "feed_halves", "host_keys", "join", "split", "x64"]


def x64() -> bool:
    """Whether JAX keeps 64-bit types (then int64 ids need nothing from this module)."""
    return bool(jax.config.jax_enable_x64)


def split(ids: Any) -> np.ndarray:
    """int64 ids as uint32 `(*shape, 2)`: `[..., 0]` the low half, `[..., 1]` the high."""
    ids = np.ascontiguousarray(ids, dtype="<i8")
    return ids.view("<u4").reshape(*ids.shape, 2)


def join(halves: Any) -> np.ndarray:
    """The int64 ids of `split` halves `(*shape, 2)` (uint32, or int32 of the same bits)."""
    halves = np.ascontiguousarray(np.asarray(halves).astype("<u4", copy=False))
    return halves.view("<i8").reshape(halves.shape[:-1])


class SplitIds:
    """int64 ids in JAX as their halves, `halves`: uint32 `(*shape, 2)`, `split`'s layout.

    What `ee.Embedding` layers receive for a model input they alone read, and a
    subclassed model for each of its 64-bit integer inputs; `shape`, `ndim` and
    `dtype` are the ids'."""

    dtype = "int64"

    def __init__(self, halves: Any) -> None:
        self.halves = halves

    @property
    def shape(self) -> tuple[Any, ...]:
        return tuple(self.halves.shape[:-1])

    @property
    def ndim(self) -> int:
        return len(self.halves.shape) - 1

    def __repr__(self) -> str:
        # Shown in errors where other layers get them: names what they are and the fix.
        return (
            f"SplitIds(shape={self.shape}: int64 ids as 32-bit halves, which JAX's 64-bit "
            "types being off calls for; only elastic_emb.Embedding layers take them. Feed "
            "other integer inputs as int32, or set JAX_ENABLE_X64=1)"
        )

    def __jax_array__(self) -> Any:
        raise ValueError(
            f"{self!r} reached something other than an elastic_emb.Embedding layer (a "
            "subclassed model's 64-bit integer inputs all arrive so)."
        )


# Through `jax.jit` and `jax.device_put` as its halves; one leaf to Keras.
jax.tree_util.register_pytree_node(
    SplitIds, lambda ids: ((ids.halves,), None), lambda _, halves: SplitIds(halves[0])
)


def host_keys(layer_name: str, ids: Any) -> np.ndarray:
    """The int64 keys of ids as the host gets them; float ids only if whole and exact."""
    ids = np.asarray(ids)
    if ids.dtype.kind == "f" or ids.dtype.name == "bfloat16":
        bits = FLOAT_MANTISSA_BITS.get(ids.dtype.name, 24)
        if not np.all((np.abs(ids) < 2.0**bits) & (np.floor(ids) == ids)):
            raise ValueError(
                f"`{layer_name}` received {ids.dtype.name} ids that are not whole numbers below "
                f"2**{bits}: distinct ids may have been merged on their way through a float. "
                "Feed ids as int64: keras.Input(..., dtype='int64'), and the data cast with "
                ".astype('int64')."
            )
    elif ids.dtype.kind not in "iub":
        raise ValueError(
            f"`{layer_name}` expects integer ids (int32 or int64). Received dtype={ids.dtype.name}"
        )
    return ids.astype(np.int64)


def _is_halves(x: Any, rank: int) -> bool:
    dtype = getattr(x, "dtype", None)
    return (
        dtype is not None
        and np.dtype(dtype) in (np.dtype("uint32"), np.dtype("int32"))
        and len(x.shape) == rank + 1
        and x.shape[-1] == 2
    )


def as_split_ids(x: Any, rank: int | None = None) -> Any:
    """`x` as `SplitIds` if it holds int64 ids JAX would cut: NumPy (or list) 64-bit
    integers, whole floats, or the halves `feed_halves` made (of an input of `rank`)."""
    if isinstance(x, SplitIds):
        return x
    if rank is not None and _is_halves(x, rank):
        return SplitIds(jax.numpy.asarray(x, dtype="uint32"))
    if isinstance(x, (list, tuple, int)):
        x = np.asarray(x)
    if isinstance(x, np.ndarray) and x.dtype.kind in "iuf" and x.dtype.itemsize == 8:
        return SplitIds(jax.numpy.asarray(split(host_keys("ids", x))))
    return x


def _nodes_of(model: keras.Model) -> list[Any]:
    nodes_by_depth: Any = getattr(model, "_nodes_by_depth", None)
    require(nodes_by_depth is not None, "Functional._nodes_by_depth", "int64 ids without x64")
    return [node for nodes in nodes_by_depth.values() for node in nodes]


# No lock: two threads that miss both compute the same value.
_plans: weakref.WeakKeyDictionary[Any, tuple[frozenset[int], frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def _plan(functional: Any) -> tuple[frozenset[int], frozenset[int]]:
    """Positions of the Functional model's int64 inputs that only ee.Embedding layers
    read, and of the others from which an ee.Embedding layer's ids come."""
    if functional not in _plans:
        nodes = _nodes_of(functional)
        only, reaching = set(), set()
        for i, tensor in enumerate(functional._inputs):
            if keras.backend.standardize_dtype(tensor.dtype) not in ("int64", "uint64"):
                continue
            readers = [n.operation for n in nodes if any(t is tensor for t in n.input_tensors)]
            if readers and all(isinstance(r, EmbeddingBase) for r in readers):
                only.add(i)
            elif _reaches_embedding(tensor, nodes):
                reaching.add(i)
        _plans[functional] = (frozenset(only), frozenset(reaching))
    return _plans[functional]


def _reaches_embedding(tensor: Any, nodes: list[Any]) -> bool:
    """Whether an ee.Embedding layer reads `tensor` or a tensor made from it."""
    made = {id(tensor)}
    grew = True
    while grew:
        grew = False
        for node in nodes:
            if any(id(t) in made for t in node.input_tensors):
                if isinstance(node.operation, EmbeddingBase):
                    return True
                for t in node.output_tensors:
                    if id(t) not in made:
                        made.add(id(t))
                        grew = True
    return False


def id_inputs(functional: Any) -> frozenset[int]:
    """Positions of the Functional model's int64 inputs that only ee.Embedding layers read."""
    return _plan(functional)[0]


def _functional_class() -> Any:
    from keras.src.models.functional import Functional

    return Functional


def _functional_of(model: keras.Model) -> Any:
    """The Functional graph that runs `model` (a Sequential model's own), or None."""
    if isinstance(model, keras.Sequential):
        model = getattr(model, "_functional", None)
    return model if isinstance(model, _functional_class()) else None


class _InputsView:
    """A Functional model seen with only some of its inputs (for Keras's conversion)."""

    def __init__(self, model: Any, inputs: list[Any]) -> None:
        self._model, self._inputs = model, inputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _wrap_input_conversion() -> None:
    """Wraps `Functional._convert_inputs_to_tensors`: the ee.Embedding inputs become
    `SplitIds`; Keras converts the others as before."""
    functional = _functional_class()
    convert: Any = getattr(functional, "_convert_inputs_to_tensors", None)
    require(convert is not None, "Functional._convert_inputs_to_tensors", "int64 ids without x64")
    if getattr(convert, "_ee_wrapped", False):
        return

    @functools.wraps(convert)
    def convert_inputs(self: Any, flat_inputs: list[Any]) -> list[Any]:
        ids, reaching = _plan(self) if not x64() else (frozenset(), frozenset())
        for i in reaching:
            if not _fits_32_bits(flat_inputs[i]):
                raise ValueError(
                    f"Model {self.name!r}: its input {self._inputs[i].name!r} reaches "
                    "elastic_emb.Embedding layers through other layers, and gets ids beyond "
                    "32 bits while JAX's 64-bit types are off: JAX would cut them. Give the "
                    "elastic_emb.Embedding layers keras.Input of their own, or set "
                    "JAX_ENABLE_X64=1."
                )
        if not ids:
            return convert(self, flat_inputs)
        others = [i for i in range(len(flat_inputs)) if i not in ids]
        view = _InputsView(self, [self._inputs[i] for i in others])
        converted = convert(view, [flat_inputs[i] for i in others]) if others else []
        out = list(flat_inputs)
        for i, x in zip(others, converted, strict=True):
            out[i] = x
        for i in ids:
            if flat_inputs[i] is not None:
                out[i] = as_split_ids(flat_inputs[i], len(self._inputs[i].shape))
        return out

    convert_inputs._ee_wrapped = True  # type: ignore[attr-defined]
    functional._convert_inputs_to_tensors = convert_inputs


def _x_positions(model: Any, x: Any) -> list[tuple[Any, int]]:
    """(key of `x` or None, input position) for each of the Functional model's inputs found."""
    inputs = model._inputs
    if isinstance(x, dict):
        struct = model._inputs_struct
        names = (
            {id(t): k for k, t in struct.items()}
            if isinstance(struct, dict)
            else {id(t): t.name for t in inputs}
        )
        return [(names[id(t)], i) for i, t in enumerate(inputs) if names.get(id(t)) in x]
    if isinstance(x, (list, tuple)):
        return [(i, i) for i in range(len(inputs))] if len(x) == len(inputs) else []
    return [(None, 0)] if len(inputs) == 1 else []


def _is_wide(x: Any) -> bool:
    """Whether `x` is host data that JAX would cut: 64-bit integers or floats."""
    return isinstance(x, np.ndarray) and x.dtype.kind in "iuf" and x.dtype.itemsize == 8


def _split_x(model: keras.Model, x: Any) -> Any:
    """`x` with the int64 ids of the model's ee.Embedding-only inputs split into halves."""
    functional = _functional_of(model)
    if functional is None:  # subclassed: which inputs are ids shows only as it runs
        return keras.tree.map_structure(
            lambda leaf: (
                SplitIds(split(leaf)) if _is_wide(leaf) and leaf.dtype.kind in "iu" else leaf
            ),
            x,
        )
    ids, mixed = _plan(functional)
    if not ids and not mixed:
        return x
    found = _x_positions(functional, x)
    if not (ids | mixed) <= {i for _, i in found}:
        names = sorted(functional._inputs[i].name for i in ids | mixed)
        raise ValueError(
            f"Model {model.name!r}: which of the data's arrays are the ids of its "
            f"elastic_emb.Embedding inputs {names} is unclear, and JAX's 64-bit types are "
            "off (JAX would cut int64 ids to 32 bits). Pass one array per model input, as a "
            "list in the inputs' order or a dict by their names, or set JAX_ENABLE_X64=1."
        )
    for key, i in found:
        leaf = x if key is None else x[key]
        if i in mixed and not _fits_32_bits(leaf):
            raise ValueError(
                f"Model {model.name!r}: its input {functional._inputs[i].name!r} reaches "
                "elastic_emb.Embedding layers through other layers, and is fed ids beyond 32 "
                "bits while JAX's 64-bit types are off: JAX would cut them. Give the "
                "elastic_emb.Embedding layers keras.Input of their own, read by them alone "
                "(split the data, not the tensor), or set JAX_ENABLE_X64=1."
            )
    positions = [(key, i) for key, i in found if i in ids]
    kind = type(x)
    if isinstance(x, (list, tuple)):
        x = list(x)
    elif isinstance(x, dict):
        x = dict(x)
    for key, i in positions:
        leaf = x if key is None else x[key]
        if isinstance(leaf, list):
            leaf = np.asarray(leaf)
        if _is_wide(leaf):
            leaf = split(host_keys(functional._inputs[i].name, leaf))
            if key is None:
                return leaf
            x[key] = leaf
    return kind(x) if kind in (list, tuple) else x


def _fits_32_bits(x: Any) -> bool:
    """Whether JAX keeps host data `x` whole with 64-bit types off (no value cut)."""
    if isinstance(x, list):
        x = np.asarray(x)
    if not _is_wide(x) or x.size == 0:
        return True
    if x.dtype.kind == "f":
        return bool(np.all(np.abs(x) < 2.0**24))  # whole float32 ids, as the layer checks
    return bool(x.min() >= -(2**31) and x.max() < 2**31)


def _split_batch(model: keras.Model, batch: Any) -> Any:
    """A batch `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)` with `_split_x` applied."""
    if isinstance(batch, (list, tuple)) and batch:
        return type(batch)([_split_x(model, batch[0]), *batch[1:]])
    return _split_x(model, batch)


class _SplitAdapter:
    """A Keras data adapter whose JAX batches have their ids split (`_split_batch`)."""

    def __init__(self, adapter: Any, model: keras.Model) -> None:
        self._adapter, self._model = adapter, model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)

    def get_jax_iterator(self) -> Any:
        # NumPy batches: Keras before 3.4 converts JAX batches in the adapter already.
        for batch in self._adapter.get_numpy_iterator():
            yield _split_batch(self._model, batch)


class _Feeding(threading.local):
    model: keras.Model | None = None


_feeding = _Feeding()


def _wrap_data_adapters() -> None:
    from keras.src.trainers import data_adapters

    make: Any = getattr(data_adapters, "get_data_adapter", None)
    require(make is not None, "trainers.data_adapters.get_data_adapter", "int64 ids without x64")
    if getattr(make, "_ee_wrapped", False):
        return

    @functools.wraps(make)
    def get_data_adapter(*args: Any, **kwargs: Any) -> Any:
        adapter = make(*args, **kwargs)
        model = _feeding.model
        return adapter if model is None or x64() else _SplitAdapter(adapter, model)

    get_data_adapter._ee_wrapped = True  # type: ignore[attr-defined]
    data_adapters.get_data_adapter = get_data_adapter


def _wrap_model_methods() -> None:
    def feeding(method: Any) -> Any:
        @functools.wraps(method)
        def wrapped(self: keras.Model, *args: Any, **kwargs: Any) -> Any:
            if x64() or not any(isinstance(lr, EmbeddingBase) for lr in _layers(self)):
                return method(self, *args, **kwargs)
            x = kwargs.get("x", args[0] if args else None)
            if all(isinstance(leaf, np.ndarray) for leaf in keras.tree.flatten(x)):
                _split_x(self, x)  # refuses before Keras starts (a refusal mid-fit
                # would leave the model's variables purged)
            outer, _feeding.model = _feeding.model, self
            try:
                return method(self, *args, **kwargs)
            finally:
                _feeding.model = outer

        wrapped._ee_wrapped = True  # type: ignore[attr-defined]
        return wrapped

    def on_batch(method: Any) -> Any:
        @functools.wraps(method)
        def wrapped(self: keras.Model, x: Any, *args: Any, **kwargs: Any) -> Any:
            if not x64() and any(isinstance(lr, EmbeddingBase) for lr in _layers(self)):
                x = _split_x(self, x)
            return method(self, x, *args, **kwargs)

        wrapped._ee_wrapped = True  # type: ignore[attr-defined]
        return wrapped

    for name, wrap in (
        ("fit", feeding),
        ("evaluate", feeding),
        ("predict", feeding),
        ("train_on_batch", on_batch),
        ("test_on_batch", on_batch),
        ("predict_on_batch", on_batch),
    ):
        method = getattr(keras.Model, name)
        if not getattr(method, "_ee_wrapped", False):
            setattr(keras.Model, name, wrap(method))


def _layers(model: keras.Model) -> list[Any]:
    return list(model._flatten_layers(include_self=False, recursive=True))


def feed_halves() -> None:
    """Installs this module's wrappers (once; each does nothing while x64 is on)."""
    _wrap_input_conversion()
    _wrap_data_adapters()
    _wrap_model_methods()
