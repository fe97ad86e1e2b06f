"""ee.Embedding behaviour: Keras integration, inference, strings, bad input, strategies."""

import inspect
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from _processes import run_python

import elastic_emb as ee
from elastic_emb.keras.patches import keras_version

HERE = Path(__file__).parent


def _model(layer, ids_per_example=3):
    inp = keras.Input((ids_per_example,), dtype="int64")
    x = keras.layers.Flatten()(layer(inp))
    return keras.Model(inp, keras.layers.Dense(1)(x))


def _data(n=64, vocab=50, ids_per_example=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (n, ids_per_example)).astype(np.int64)
    return x, rng.normal(size=(n, 1)).astype(np.float32)


def _keras_optimizer_classes():
    classes = []
    for name, cls in inspect.getmembers(keras.optimizers, inspect.isclass):
        if not issubclass(cls, keras.optimizers.Optimizer) or cls is keras.optimizers.Optimizer:
            continue
        params = inspect.signature(cls.__init__).parameters
        required = [
            p
            for p in list(params.values())[1:]
            if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ]
        if not required:  # wrappers (LossScaleOptimizer, MultiOptimizer) need an inner optimizer
            classes.append(name)
    return classes


@pytest.mark.parametrize("optimizer_name", _keras_optimizer_classes())
def test_one_push_per_training_step_with_every_compile_optimizer(optimizer_name):
    # A push hung on a zero gradient could be pruned by the graph optimizer
    # for some compile optimizers; the table's iteration count proves it ran.
    x, y = _data()
    stock = _model(keras.layers.Embedding(int(x.max()) + 1, 4))
    stock.compile(getattr(keras.optimizers, optimizer_name)(), "mse")
    try:
        stock.fit(x, y, batch_size=8, epochs=1, verbose=0)
    except Exception as e:  # e.g. Keras 3.11's Muon on TF 2.16 variables
        pytest.skip(f"Keras {keras.__version__}'s {optimizer_name} fails on a stock model: {e}")
    layer = ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), name="count")
    model = _model(layer)
    model.compile(getattr(keras.optimizers, optimizer_name)(), "mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert layer.table.iterations == 2 * (len(x) // 8)
    assert np.all(layer.table.metadata(np.unique(x))[1] >= 1)


def test_frozen_layer_neither_inserts_nor_pushes():
    layer = ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), name="frozen")
    model = _model(layer)
    layer.trainable = False
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert len(layer.table) == 0 and layer.table.iterations == 0


def test_positional_keras_signature():
    layer = ee.Embedding(1000, 16)
    assert layer.output_dim == 16 and layer.input_dim == 1000
    assert layer(tf.constant([[1, 2]])).shape == (1, 2, 16)


def test_string_mask_zero_masks_empty_strings():
    layer = ee.Embedding(4, key_dtype="string", mask_zero=True, name="smask")
    words = tf.constant([["a", ""], ["", "b"]])
    np.testing.assert_array_equal(layer.compute_mask(words).numpy(), [[True, False], [False, True]])


def test_mask_zero_with_combiner_rejected():
    with pytest.raises(ValueError, match="mask_zero"):
        ee.Embedding(4, combiner="sum", mask_zero=True)


def test_inference_never_inserts_and_uses_initial_values():
    layer = ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), name="infer")
    model = _model(layer)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    rows, iterations = len(layer.table), layer.table.iterations
    unseen = np.arange(1000, 1012, dtype=np.int64).reshape(4, 3)
    model.predict(unseen, verbose=0)
    model.evaluate(np.concatenate([x, unseen]), np.zeros((len(x) + 4, 1)), verbose=0)
    assert len(layer.table) == rows
    assert layer.table.iterations == iterations
    # Inference rows: trained values for seen ids, the deterministic initial
    # value (equal to a fresh table's, same seed) for unseen ones.
    out = layer(unseen, training=False).numpy().reshape(-1, 4)
    fresh = ee.Table(4, initializer="uniform", seed=layer.table.seed, name="fresh")
    np.testing.assert_array_equal(out, fresh.pull(unseen.reshape(-1), train=False))
    seen = x[:2]
    keys, values = layer.table.export_rows()
    lookup = dict(zip(keys.tolist(), values, strict=True))
    expected = np.stack([lookup[k] for k in seen.reshape(-1).tolist()])
    np.testing.assert_array_equal(layer(seen, training=False).numpy().reshape(-1, 4), expected)


def test_training_none_pushes_gradients_but_never_inserts():
    # Keras calls layers with training=None inside a subclassed model whose
    # call() takes no `training` argument: fit must still train, predict
    # must still not insert.
    layer = ee.Embedding(
        2, optimizer=ee.optimizers.SGD(1.0), embeddings_initializer="zeros", name="none"
    )
    ids = tf.constant([[4, 4, 9]], tf.int64)
    layer(ids)
    assert len(layer.table) == 0
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids))
    tape.gradient(loss, layer.trainable_variables)
    keys, values = layer.table.export_rows()
    got = dict(zip(keys.tolist(), values[:, 0].tolist(), strict=True))
    assert got == {4: -2.0, 9: -1.0}


def test_shapes_like_stock_embedding():
    layer = ee.Embedding(5, name="shapes")
    stock = keras.layers.Embedding(10, 5)
    for shape in [(3,), (2, 4), (2, 3, 2)]:
        ids = tf.zeros(shape, tf.int64)
        assert layer(ids).shape == stock(ids).shape
        assert layer.compute_output_shape(shape) == stock.compute_output_shape(shape)


def test_int32_ids_equal_int64_ids():
    layer = ee.Embedding(4, name="int32")
    ids = np.array([[1, 2], [3, 1]])
    np.testing.assert_array_equal(
        layer(ids.astype(np.int32)).numpy(), layer(ids.astype(np.int64)).numpy()
    )


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.bool])
def test_float_and_bool_ids_are_cast_like_the_stock_layer(dtype):
    layer = ee.Embedding(4, name=f"cast_{dtype.name}")
    ids = np.array([[0, 1, 1], [1, 0, 0]])
    got = layer(tf.constant(ids, dtype), training=False)
    np.testing.assert_array_equal(got, layer(tf.constant(ids, tf.int64), training=False))
    assert len(layer.table) == 0


def test_string_ids_without_string_keys_rejected():
    layer = ee.Embedding(4, name="strings_as_ints")
    with pytest.raises(ValueError, match="integer ids") as err:
        layer(tf.constant([["a", "b"]]))
    assert "string" in str(err.value)
    assert len(layer.table) == 0


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"output_dim": 0}, "output_dim"),
        ({"output_dim": -3}, "output_dim"),
        ({"output_dim": 2.5}, "output_dim"),
        ({"output_dim": 4, "combiner": "max"}, "combiner"),
        ({"output_dim": 4, "key_dtype": "int32"}, "key_dtype"),
        ({"output_dim": 4, "embeddings_initializer": "orthogonal"}, "embeddings_initializer"),
        ({"output_dim": 4, "optimizer": "adadelta"}, "optimizer"),
        ({"output_dim": 4, "optimizer": keras.optimizers.Adadelta()}, "Adadelta"),
        ({"output_dim": 4, "optimizer": keras.optimizers.SGD(clipnorm=1.0)}, "clipnorm"),
        ({"output_dim": 4, "embeddings_regularizer": "l2"}, "embeddings_regularizer"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        ee.Embedding(**kwargs)


def test_keras_optimizer_is_converted_with_its_arguments():
    layer = ee.Embedding(
        4, optimizer=keras.optimizers.Adam(learning_rate=0.02, beta_1=0.8), name="conv"
    )
    # Keras holds the learning rate in a float32 variable and trains with that value.
    assert layer.optimizer == ee.optimizers.Adam(learning_rate=float(np.float32(0.02)), beta_1=0.8)


def test_config_round_trip():
    layer = ee.Embedding(
        6,
        optimizer=ee.optimizers.Ftrl(learning_rate=0.3, l1_regularization_strength=0.01),
        embeddings_initializer=keras.initializers.TruncatedNormal(stddev=0.2),
        combiner="mean",
        mask_zero=False,
        seed=11,
        name="cfg",
    )
    config = layer.get_config()
    clone = ee.Embedding.from_config(config)
    assert clone.get_config() == config
    assert clone.optimizer == layer.optimizer
    assert clone.table.initializer == layer.table.initializer
    # Same seed and initializer: the same initial rows.
    keys = np.arange(20)
    np.testing.assert_array_equal(
        clone.table.pull(keys, train=False), layer.table.pull(keys, train=False)
    )


def test_sequential_functional_and_subclassed_models_train_the_same():
    x, y = _data(vocab=30)

    def sequential():
        return keras.Sequential(
            [
                keras.Input((3,), dtype="int64"),
                ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), seed=5),
                keras.layers.Flatten(),
                keras.layers.Dense(1, kernel_initializer="ones"),
            ]
        )

    def functional():
        inp = keras.Input((3,), dtype="int64")
        x = ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), seed=5)(inp)
        x = keras.layers.Flatten()(x)
        return keras.Model(inp, keras.layers.Dense(1, kernel_initializer="ones")(x))

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.embedding = ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), seed=5)
            self.flatten = keras.layers.Flatten()
            self.dense = keras.layers.Dense(1, kernel_initializer="ones")

        def call(self, ids):
            return self.dense(self.flatten(self.embedding(ids)))

    losses = []
    for build in (sequential, functional, Subclassed):
        model = build()
        model.compile(keras.optimizers.SGD(0.1), "mse")
        losses.append(
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
        )
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    np.testing.assert_allclose(losses[2], losses[0], rtol=1e-6)


def test_inside_tf_function_with_gradient_tape():
    layer = ee.Embedding(
        3, optimizer=ee.optimizers.SGD(1.0), embeddings_initializer="zeros", name="tffn"
    )
    ids = tf.constant([[1, 2], [2, 2]], tf.int64)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out = layer(ids, training=True)
            loss = tf.reduce_sum(out)
        tape.gradient(loss, layer.trainable_variables)
        return out

    step()
    step()
    # d loss / d row = number of occurrences; SGD lr 1 from zeros, 2 steps.
    keys, values = layer.table.export_rows()
    got = dict(zip(keys.tolist(), values[:, 0].tolist(), strict=True))
    assert got == {1: -2.0, 2: -6.0}
    assert layer.table.iterations == 2


def test_string_keys():
    layer = ee.Embedding(4, key_dtype="string", name="strings")
    words = tf.constant([["apple", "pear"], ["apple", ""]])
    out = layer(words, training=True).numpy()
    np.testing.assert_array_equal(out[0, 0], out[1, 0])
    assert not np.array_equal(out[0, 0], out[0, 1])
    keys = ee.layers.string_keys(words).numpy()
    assert keys.dtype == np.int64 and len(set(keys.reshape(-1).tolist())) == 3
    np.testing.assert_array_equal(out.reshape(-1, 4), layer.table.pull(keys.reshape(-1)))
    with pytest.raises(ValueError, match="strings"):
        layer(tf.constant([[1, 2]], tf.int64))


def test_string_fingerprint_is_stable_across_processes():
    words = ["apple", "pear", "", "ünïcode"]
    code = (
        "import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='3'\n"
        "import tensorflow as tf, elastic_emb as ee\n"
        f"print(ee.layers.string_keys(tf.constant({words!r})).numpy().tolist())"
    )
    out = run_python("-c", code)
    here = ee.layers.string_keys(tf.constant(words)).numpy().tolist()
    assert eval(out.strip().splitlines()[-1]) == here


def test_host_string_keys_are_the_graph_s_keys():
    """`ee.string_keys` (C++, no TensorFlow) against tf.fingerprint, on every length class
    of the hash (0-16, 17-32, 33-64, longer) and on str as UTF-8."""
    rng = np.random.default_rng(0)
    words = [rng.bytes(n) for n in range(300)] + [b"", b"\x00", "ünïcode", "apple"]
    graph = ee.layers.string_keys(tf.constant(words)).numpy()
    np.testing.assert_array_equal(ee.string_keys(words), graph)
    np.testing.assert_array_equal(
        ee.string_keys(np.array(words[-2:]).reshape(2, 1)), graph[-2:, None]
    )
    with pytest.raises(TypeError, match="item 1 is int"):
        ee.string_keys(["apple", 3])


@pytest.mark.skipif(
    keras_version() < (3, 10),
    reason="before Keras 3.10 a stock model under MirroredStrategy trains or reports its loss "
    "unlike one device too (docs/keras.md#supported-versions)",
)
def test_mirrored_strategy_matches_single_device():
    # Two logical CPU devices must be configured before TensorFlow starts, so
    # this runs in its own process.
    assert "MATCH" in run_python(HERE / "_mirrored_worker.py")


def test_checkpoint_callback_resume_equals_uninterrupted(tmp_path):
    def run(*args):
        run_python(HERE / "_resume_worker.py", *args)

    run(tmp_path / "full.npz", 2)
    run(tmp_path / "half.npz", 1, tmp_path / "ckpt")
    run(tmp_path / "resumed.npz", 2, tmp_path / "ckpt")
    full, half, resumed = (np.load(tmp_path / f"{n}.npz") for n in ("full", "half", "resumed"))
    assert sorted(full.files) == sorted(resumed.files)
    for name in full.files:
        np.testing.assert_array_equal(resumed[name], full[name], err_msg=name)
    # And the comparison can fail: one epoch is not two.
    assert not np.array_equal(half["a_values"], full["a_values"])


def test_device_argument_is_checked_and_needs_a_gpu_for_gpu():
    with pytest.raises(ValueError, match='`device` must be "cpu" or "gpu"'):
        ee.Embedding(4, device="tpu", name="device_tpu")
    layer = ee.Embedding(4, device="cpu", name="device_cpu")
    assert layer.get_config()["device"] == "cpu" and layer.table.device == "cpu"
    if not (ee._core.with_cuda and ee._core.cuda_device_count() > 0):
        with pytest.raises(RuntimeError, match=r"without CUDA|no CUDA device is visible"):
            ee.Embedding(4, device="gpu", name="device_gpu")


def test_rebuilt_models_keep_their_table_names_and_resume_from_a_checkpoint(tmp_path):
    """A second build of the same model (a notebook cell run twice, clone_model) keeps its
    table names, so ee.callbacks.Checkpoint resumes it with the first model's trained rows."""
    x, y = _data(vocab=40, seed=3)

    def build() -> keras.Model:
        layer = ee.Embedding(4, optimizer=ee.optimizers.Adagrad(0.3), name="rebuilt_ids")
        model = _model(layer)
        model.compile(optimizer="sgd", loss="mse")
        return model

    first = build()
    first.fit(
        x, y, epochs=1, batch_size=16, verbose=0, callbacks=[ee.callbacks.Checkpoint(tmp_path)]
    )
    trained = first.predict(x, verbose=0)
    first_table = first.get_layer("rebuilt_ids").table

    second = build()  # `first` is still alive
    second_table = second.get_layer("rebuilt_ids").table
    assert second_table.name == first_table.name == "rebuilt_ids"
    assert ee.placement.registered_tables()["rebuilt_ids"] is second_table
    assert len(second_table) == 0  # fresh rows, as a fresh stock Keras model has
    # epochs=1 was done: resuming restores everything and trains no further epoch.
    second.fit(x, y, epochs=1, verbose=0, callbacks=[ee.callbacks.Checkpoint(tmp_path)])
    np.testing.assert_array_equal(second.predict(x, verbose=0), trained)
    keys = np.unique(x)
    np.testing.assert_array_equal(second_table.pull(keys), first_table.pull(keys, train=False))

    clone = keras.models.clone_model(second)
    assert clone.get_layer("rebuilt_ids").table.name == "rebuilt_ids"
    assert ee.placement.registered_tables()["rebuilt_ids"] is clone.get_layer("rebuilt_ids").table
    # The older tables still work; they are just no longer the ones ee.save() writes.
    assert first_table.pull(keys[:3], train=False).shape == (3, 4)


def _id_model(name):
    ids = keras.Input(shape=(), dtype="int64", name=f"{name}_ids")
    layer = ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), name=name)
    model = keras.Model(ids, keras.layers.Dense(1)(layer(ids)))
    model.compile("sgd", "mse")
    return model, layer


@pytest.mark.parametrize(
    "ids, expected",
    [
        (np.array(["a", "b"] * 4), "its data are strings"),
        (np.array([b"a", b"b"] * 4, dtype=object), "its data are strings"),
        ((np.arange(8) + 2**24).astype(np.float32), "its data are float32"),
        (np.arange(8, dtype=np.float64), "its data are float64"),
    ],
    ids=["str", "bytes_object", "float32", "float64"],
)
def test_ids_of_a_string_or_float_dtype_for_an_int_input_are_refused_first(ids, expected):
    model, layer = _id_model(f"refused_{ids.dtype.kind}_{len(str(ids.dtype))}")
    name = model.inputs[0].name
    labels = np.zeros((8, 1), np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(4)
    calls = [
        lambda: model.fit(ids, labels, verbose=0),
        lambda: model.fit({name: ids}, labels, verbose=0),
        lambda: model.fit(dataset, verbose=0),
        lambda: model.evaluate(ids, labels, verbose=0),
        lambda: model.predict(ids, verbose=0),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=expected) as error:
            call()
        assert repr(name) in str(error.value) and "int64" in str(error.value)
    assert len(layer.table) == 0  # refused before a row was made
    model.fit(np.arange(8), labels, verbose=0)  # int64 ids train
    assert len(layer.table) == 8


def test_float_ids_train_while_exact_and_are_refused_where_a_float_merges_ids():
    # A Sequential model without an Input feeds its layers float32 ids (as in Keras).
    layer = ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), name="float_guard")
    model = keras.Sequential([layer, keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    labels = np.zeros((4, 1), np.float32)
    model.fit(np.array([0, 1, 2**24 - 1, 7]), labels, verbose=0)
    np.testing.assert_array_equal(np.sort(layer.table.export_rows()[0]), [0, 1, 7, 2**24 - 1])
    # 2**24 + 1 reads 2**24 in float32: two distinct ids, one row. Refused, nothing stored.
    with pytest.raises(tf.errors.InvalidArgumentError, match="not whole numbers below 2\\*\\*24"):
        model.fit(np.array([2**24, 2**24 + 1, 3, 4]), labels, verbose=0)
    assert len(layer.table) == 4
