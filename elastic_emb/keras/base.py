"""What `ee.Embedding` is on every Keras backend: its arguments, table, config and saving.

The backends differ only in how a step reaches the table: `elastic_emb.keras.layers`
(TensorFlow: `tf.numpy_function` and a custom gradient) and `elastic_emb.keras.on_jax`
(JAX: host callbacks inside the jitted step). Neither TensorFlow nor JAX is imported here.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import keras
import numpy as np

from elastic_emb.errors import ElasticEmbWarning
from elastic_emb.keras.weights import carry_rows
from elastic_emb.keras_range import check_keras, keras_version, require
from elastic_emb.persistence import checkpoint
from elastic_emb.tables import registry
from elastic_emb.tables.policies import initializers, optimizers
from elastic_emb.tables.table import TableConfig, TableState

__all__ = ["MAX_SAVED_TABLE_BYTES", "EmbeddingBase", "embedding_layers"]

check_keras()  # Keras 3.3 or newer

COMBINERS = (None, "sum", "mean", "sqrtn")
# Above this a table's rows are not written into Keras weights files (ee.save is).
MAX_SAVED_TABLE_BYTES = 4 << 30
# Float ids are exact whole numbers below 2**bits.
FLOAT_MANTISSA_BITS = {"bfloat16": 8, "float16": 11, "float32": 24, "float64": 53}


def _policy_config(policy: Any) -> dict[str, Any] | None:
    return None if policy is None else policy.to_dict()


class EmbeddingBase(keras.layers.Layer):
    """Maps integer (or string) ids to dense vectors stored in an `elastic_emb.Table`.

    A drop-in replacement for `keras.layers.Embedding` with no vocabulary
    size: any int64 id gets a row, created on first training use with a
    deterministic initial value. The rows are trained by the layer's own
    `optimizer`, inside the table, on the rows a step touches only; the
    optimizer given to `model.compile` trains the other weights.

    Example:
        >>> layer = ee.Embedding(output_dim=8, optimizer=ee.optimizers.SGD(0.1), name="user")
        >>> layer(np.array([[1, 2], [3, 4]])).shape
        TensorShape([2, 2, 8])  # (2, 2, 8) on JAX

    Args:
        output_dim: int, width of an embedding vector.
        optimizer: `elastic_emb.tables.policies.optimizers.*`, `keras.optimizers.*` (SGD,
            Adagrad, Adam, Ftrl; converted) or a name. Defaults to
            `Adagrad(learning_rate=0.05)`.
        embeddings_initializer: Keras initializer name or object: zeros,
            ones, constant, uniform (default, as Keras), normal,
            truncated_normal.
        combiner: None, "sum", "mean" or "sqrtn". None maps ids of shape
            `(..., )` to `(..., output_dim)` like `keras.layers.Embedding`;
            a combiner reduces the ids of each example (a `tf.RaggedTensor`
            or `tf.SparseTensor` of shape `(batch, None)`, or a dense
            `(batch, k)` tensor) to one `(batch, output_dim)` vector.
        key_dtype: "int64" or "string" (strings hashed by `string_keys`).
        mask_zero: bool, as in `keras.layers.Embedding`: id 0 (the empty
            string with `key_dtype="string"`) is padding and the layer
            produces a mask. Not with a combiner.
        seed: int, initialization seed; defaults to a hash of the layer name,
            so re-created models get the same initial rows.
        input_dim: accepted for drop-in compatibility; the table has no
            vocabulary size. Used only as the fan-in of a variance-scaling
            initializer (e.g. "glorot_uniform"). `Embedding(input_dim,
            output_dim)` written positionally, as for `keras.layers.Embedding`,
            also works.
        name: str, layer name; also the table name in checkpoints.
        device: "cpu" (default) or "gpu": where the table's rows and
            optimizer slots live (`ee.Table(device=...)`). The layer hands
            the rows to TensorFlow through host memory.
        nonfinite: "raise" (default) or "skip": a step whose gradient for
            this table holds NaN or ±Inf raises `ValueError` (which stops
            `fit`), or is skipped by the table and counted in
            `layer.table.nonfinite_pushes`. The table is left unchanged either
            way (`ee.Table(nonfinite=...)`).
        row_dtype: "float32" (default), "float16" or "bfloat16": how the
            table stores its rows (`ee.Table(row_dtype=...)`, docs/storage.md).
        admission: None (default) or an `ee.admission` policy: which ids get
            a row (`ee.Table(admission=...)`, docs/storage.md).
        eviction: None (default) or an `ee.eviction` policy: which rows the
            table lets go (`ee.Table(eviction=...)`).
        storage: None (default) or `ee.storage.Tiered(ram_rows, path)`: the
            table's coldest rows on local disk (`ee.Table(storage=...)`).

    Call arguments:
        inputs: ids (int32/int64, or string with `key_dtype="string"`).
        training: bool or None. True: unseen ids are inserted and the
            gradient is pushed once per step. False (inference): nothing is
            inserted or pushed. None (e.g. a subclassed model whose `call`
            takes no `training` argument): nothing is inserted by the lookup,
            but a gradient, if one is computed, is still pushed.

    Returns:
        float32 `inputs.shape + (output_dim,)`, or `(batch, output_dim)`
        with a combiner (in the layer's compute dtype).

    Raises:
        ValueError: for invalid arguments or ids of a non-integer dtype.
    """

    # Whether Keras may compile a step holding the layer (TensorFlow: no, XLA cannot
    # compile tf.numpy_function; JAX: yes, the table is reached by host callbacks).
    SUPPORTS_JIT = False

    def __init__(
        self,
        output_dim: int,
        optimizer: Any = None,
        embeddings_initializer: Any = "uniform",
        combiner: str | None = None,
        key_dtype: str = "int64",
        mask_zero: bool = False,
        seed: int | None = None,
        input_dim: int | None = None,
        name: str | None = None,
        device: str = "cpu",
        nonfinite: str = "raise",
        admission: Any = None,
        eviction: Any = None,
        row_dtype: str = "float32",
        storage: Any = None,
        **kwargs: Any,
    ) -> None:
        for unsupported in ("embeddings_regularizer", "embeddings_constraint"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(
                    f"`{unsupported}` is not supported by elastic_emb.Embedding (a dense "
                    "penalty over a table without a vocabulary is undefined; regularize "
                    f"through the optimizer instead, e.g. Ftrl's l2). Received: "
                    f"{unsupported}={kwargs[unsupported]!r}"
                )
            kwargs.pop(unsupported, None)
        weights = kwargs.pop("weights", None)
        if isinstance(optimizer, int) and not isinstance(optimizer, bool):
            # keras.layers.Embedding(input_dim, output_dim, ...) written positionally.
            input_dim, output_dim, optimizer = output_dim, optimizer, None
        # Ids are never cast to the compute dtype (a float id is an error).
        kwargs.setdefault("autocast", False)
        super().__init__(name=name, **kwargs)
        if isinstance(output_dim, bool) or not isinstance(output_dim, int) or output_dim <= 0:
            raise ValueError(
                f"`output_dim` must be a positive integer. Received: output_dim={output_dim!r}"
            )
        if combiner not in COMBINERS:
            raise ValueError(
                f"`combiner` must be one of {COMBINERS}. Received: combiner={combiner!r}"
            )
        if mask_zero and combiner is not None:
            raise ValueError(
                "`mask_zero=True` cannot be used with a `combiner` (the output has no id axis "
                f"to mask). Received: mask_zero=True, combiner={combiner!r}"
            )
        if key_dtype not in ("int64", "string"):
            raise ValueError(
                f'`key_dtype` must be "int64" or "string". Received: key_dtype={key_dtype!r}'
            )
        self.output_dim = output_dim
        self.combiner = combiner
        self.key_dtype = key_dtype
        self.mask_zero = bool(mask_zero)
        self.input_dim = input_dim
        self.supports_masking = self.mask_zero
        self.supports_jit = self.SUPPORTS_JIT
        initializer = initializers.get(
            embeddings_initializer, shape=(input_dim, output_dim) if input_dim else None
        )
        config = TableConfig.make(
            output_dim, optimizer, initializer, self.name, seed, nonfinite, admission, eviction,
            row_dtype, storage,
        )  # fmt: skip
        self.table = registry.place(config, device)
        self.device = device
        # TensorFlow: set by elastic_emb.keras.models while the model is exported (not tracked).
        object.__setattr__(self, "_serving_table", None)
        if weights is not None:
            self._import_pretrained(weights)

    @property
    def optimizer(self) -> optimizers.Optimizer:
        return self.table.optimizer

    @property
    def push_trigger(self) -> Any:
        """The zero variable whose gradient is this layer's push (`build` makes it)."""
        return self._push_trigger

    def build(self, input_shape: Any = None) -> None:
        if getattr(self, "_push_trigger", None) is not None:
            return
        # The gradient of this zero variable is the output of the push, so
        # the push runs exactly once per step whatever optimizer model.compile
        # uses (the optimizer's update consumes it; it stays zero).
        self._push_trigger = self.add_weight(
            shape=(1,), initializer="zeros", trainable=True, name="push_trigger"
        )
        # Keras optimizers assign such a variable its gradient (zero) instead
        # of running their update rule: no slots, no update math per step.
        # (Before Keras 3.10, a step whose only trainable variables are such
        # raises "No gradients provided": there the update rule runs, on a
        # zero gradient, which leaves the trigger at zero.)
        self._push_trigger.overwrite_with_gradient = keras_version() >= (3, 10)
        self._push_trigger.ee_push_trigger = True  # (not a dense weight: dense_ps)
        self.built = True

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        shape = tuple(input_shape)
        if self.combiner is not None:
            return (shape[0], self.output_dim)
        return (*shape, self.output_dim)

    def compute_output_spec(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        shape = self.compute_output_shape(inputs.shape)
        if self.combiner is None and getattr(inputs, "ragged", False):  # (Keras >= 3.9)
            return keras.KerasTensor(shape, dtype=self.compute_dtype, ragged=True)
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    def get_config(self) -> dict[str, Any]:
        base_config = super().get_config()
        config = {
            "output_dim": self.output_dim,
            "optimizer": self.table.optimizer.get_config(),
            "embeddings_initializer": keras.initializers.serialize(
                self.table.initializer.to_keras()
            ),
            "combiner": self.combiner,
            "key_dtype": self.key_dtype,
            "mask_zero": self.mask_zero,
            "seed": self.table.seed,
            "input_dim": self.input_dim,
            "device": self.device,
            "nonfinite": self.table.nonfinite,
            "row_dtype": self.table.row_dtype,
            "admission": _policy_config(self.table.admission),
            "eviction": _policy_config(self.table.eviction),
            "storage": _policy_config(self.table.storage),
        }
        return {**base_config, **config}

    # Keras saving: `model.save`, `save_weights`, ModelCheckpoint and
    # BackupAndRestore store the table's rows with the layer's variables;
    # `get_weights` and the state tree carry them by value (`elastic_emb.keras.weights`).

    def check_keras_size(self, api: str) -> None:
        """Raises if the table is too big for `api` (a Keras file, `get_weights()`) to hold."""
        table = self.table
        width = table.dim * (1 + table.num_slots) * 4 + 16  # value, slots, key, metadata
        size = len(table) * width
        if size > MAX_SAVED_TABLE_BYTES:
            raise ValueError(
                f"Table {table.name!r} holds {len(table):,} rows ({size / 2**30:.1f} GiB), more "
                f"than elastic_emb lets {api} hold (elastic_emb.keras.base.MAX_SAVED_TABLE_BYTES = "
                f"{MAX_SAVED_TABLE_BYTES / 2**30:.0f} GiB). Save the tables with ee.save(...) "
                "or ee.callbacks.Checkpoint, and the dense weights with Keras."
            )

    def save_own_variables(self, store: Any) -> None:
        super().save_own_variables(store)  # the push trigger, as "0"
        self.check_keras_size("a Keras weights file")
        table = self.table
        state = table.export_state()
        store["table_config"] = np.frombuffer(
            json.dumps({**table.config(), "num_slots": table.num_slots}).encode(), np.uint8
        )
        store["table_iterations"] = np.array([state.iterations], np.int64)
        for field in TableState.FIELDS:
            store[f"table_{field}"] = getattr(state, field)
        if state.counts is not None:
            store["table_counts"] = state.counts

    def load_own_variables(self, store: Any) -> None:
        self._push_trigger.assign(np.asarray(store["0"]))
        saved_keys = set(store.keys())  # (Keras < 3.11 stores have no `in`)
        if "table_config" not in saved_keys:
            warnings.warn(
                f"The saved layer {self.name!r} holds no table rows (written by elastic_emb "
                "0.1, which saved none): its table keeps its current rows.",
                ElasticEmbWarning,
                stacklevel=2,
            )
            return
        saved = json.loads(np.asarray(store["table_config"]).tobytes())
        checkpoint.check_fits(self.table, saved, f"the saved layer {self.name!r}")
        arrays = {f: np.asarray(store[f"table_{f}"]) for f in TableState.FIELDS}
        iterations = int(np.asarray(store["table_iterations"])[0])
        counts = np.asarray(store["table_counts"]) if "table_counts" in saved_keys else None
        self.table.load_state(TableState(**arrays, iterations=iterations, counts=counts))

    def count_params(self) -> int:
        """Values held by the table (rows × width), as `model.summary()` shows them."""
        return len(self.table) * self.output_dim

    # Internals.

    def _import_pretrained(self, weights: Any) -> None:
        """`weights=matrix` or `[matrix]`: row i of the matrix becomes the row of id i."""
        if isinstance(weights, list | tuple):
            if len(weights) != 1:
                raise ValueError(
                    "`weights` must be one (n, output_dim) matrix, or a list holding it, as for "
                    f"keras.layers.Embedding. Received: a list of {len(weights)}"
                )
            weights = weights[0]
        matrix = np.asarray(weights)
        if matrix.ndim != 2 or matrix.shape[1] != self.output_dim:
            raise ValueError(
                f"`weights` must hold one matrix of shape (n, {self.output_dim}). "
                f"Received shape={matrix.shape}"
            )
        self.table.import_rows(np.arange(matrix.shape[0], dtype=np.int64), matrix)


def embedding_layers(model: keras.Model) -> list[EmbeddingBase]:
    """The ee.Embedding layers of `model`, nested ones included."""
    require(
        hasattr(model, "_flatten_layers"), "Layer._flatten_layers", "finding ee.Embedding layers"
    )
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if isinstance(layer, EmbeddingBase)
    ]


carry_rows(embedding_layers)  # Keras's weights by value carry the tables' rows
