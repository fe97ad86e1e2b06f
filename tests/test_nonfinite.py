"""Non-finite gradients never reach a table: `nonfinite="raise"` (default) or `"skip"`.

References are independent of the check: the table's state exported before a
refused push (compared bit for bit), a twin table that only ever received the
finite pushes, and the C++ core driven directly (the push path without the
check, i.e. as before). Keras tests import TensorFlow lazily, so the GPU test
runs on a machine without it.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import elastic_emb as ee
from elastic_emb import _core
from elastic_emb.tables.local import LocalTable, core_options
from elastic_emb.tables.policies import optimizers as eo
from elastic_emb.tables.table import TableConfig, TableState, check_finite_gradients

_names = itertools.count()

OPTIMIZERS = {
    "sgd": lambda: eo.SGD(learning_rate=0.25, momentum=0.5),
    "adagrad": lambda: eo.Adagrad(learning_rate=0.1),
    "adam": lambda: eo.Adam(learning_rate=0.01),
    "ftrl": lambda: eo.Ftrl(learning_rate=0.2, l1_regularization_strength=0.01),
}
BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
DIM = 6


def _name() -> str:
    return f"nonfinite_{next(_names)}"


def _local(
    nonfinite: str = "raise", optimizer: str = "adam", name: str | None = None
) -> LocalTable:
    config = TableConfig.make(
        DIM, OPTIMIZERS[optimizer](), "uniform", name or _name(), seed=5, nonfinite=nonfinite
    )
    return LocalTable(config)


def _grads(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.normal(size=(n, DIM)).astype(np.float32)


def _with_bad(grads: np.ndarray, value: float, count: int, seed: int = 0) -> np.ndarray:
    """`grads` with `count` values, at random positions, replaced by `value`."""
    out = grads.copy()
    positions = np.random.default_rng(seed).choice(out.size, count, replace=False)
    out.reshape(-1)[positions] = value
    return out


def _state(table: Any) -> dict[str, Any]:
    """Everything the table holds, rows sorted by key (order-free comparison)."""
    s = table.export_state()
    order = np.argsort(s.keys)
    state = {f: getattr(s, f)[order] for f in TableState.FIELDS}
    return {**state, "iterations": s.iterations}


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["iterations"] == b["iterations"]
    for field in TableState.FIELDS:
        assert a[field].dtype == b[field].dtype, field
        # Bit for bit (NaN-proof: compare the bytes).
        assert a[field].tobytes() == b[field].tobytes(), field


def _train(table: Any, rng: np.random.Generator, steps: int = 3) -> None:
    for _ in range(steps):
        keys = rng.integers(0, 20, 12).astype(np.int64)  # duplicates included
        table.push(keys, _grads(rng, len(keys)))


# The raise policy (default).


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_raise_names_the_table_and_count_and_leaves_the_table_bit_identical(
    optimizer: str, bad: str
) -> None:
    name = _name()
    table = _local("raise", optimizer, name)
    rng = np.random.default_rng(1)
    _train(table, rng)
    before = _state(table)
    keys = np.arange(10, 18, dtype=np.int64)  # known keys and unseen ones (20..)
    keys[-2:] = [100, 101]
    grads = _with_bad(_grads(rng, len(keys)), BAD[bad], count=3)
    with pytest.raises(ValueError) as info:
        table.push(keys, grads)
    message = str(info.value)
    assert repr(name) in message
    assert f"3 of {len(keys) * DIM} gradient values are not finite" in message
    assert "nonfinite='skip'" in message
    _assert_same_state(_state(table), before)  # no row inserted, no slot or step changed
    assert table.nonfinite_pushes == 0
    np.testing.assert_array_equal(table.metadata([100, 101])[0], [-1, -1])


def test_the_default_policy_is_raise() -> None:
    table = ee.Table(DIM, name=_name())
    assert table.nonfinite == "raise" and table.config()["nonfinite"] == "raise"
    grads = np.zeros((1, DIM), np.float32)
    grads[0, 3] = np.nan
    with pytest.raises(ValueError, match="1 of 6 gradient values are not finite"):
        table.push([1], grads)
    assert len(table) == 0 and table.iterations == 0


# The skip policy.


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_skip_leaves_the_table_unchanged_and_counts(optimizer: str, bad: str) -> None:
    table = _local("skip", optimizer)
    rng = np.random.default_rng(2)
    _train(table, rng)
    before = _state(table)
    for i in range(3):
        keys = np.array([1, 2, 2, 50 + i], np.int64)
        table.push(keys, _with_bad(_grads(rng, 4), BAD[bad], count=1 + i, seed=i))
        _assert_same_state(_state(table), before)
        assert table.nonfinite_pushes == i + 1
    assert table.iterations == before["iterations"]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_finite_pushes_are_applied_as_without_the_skipped_ones(optimizer: str) -> None:
    """A table that skipped pushes equals a twin that never got them, and both equal the
    C++ core driven directly (the push path without any check)."""
    skipping, twin = _local("skip", optimizer), _local("raise", optimizer)
    core = _core.Table(core_options(twin._config))
    rng = np.random.default_rng(3)
    for step in range(1, 7):
        keys = rng.integers(0, 30, 16).astype(np.int64)
        grads = _grads(rng, len(keys))
        skipping.push(keys, _with_bad(grads, np.nan, 2, seed=step))  # skipped
        skipping.push(keys, grads)
        twin.push(keys, grads)
        core.push(keys, grads, twin.optimizer.learning_rate_at(step - 1), step)
    assert skipping.nonfinite_pushes == 6 and skipping.iterations == twin.iterations == 6
    _assert_same_state(_state(skipping), _state(twin))
    arrays = core.export_rows()
    order = np.argsort(arrays[0])
    direct = {f: a[order] for f, a in zip(TableState.FIELDS, arrays, strict=True)}
    _assert_same_state(_state(twin), {**direct, "iterations": 6})


def test_huge_finite_gradients_are_applied() -> None:
    # 1e30 is far from float32's limit (3.4e38) even summed over every row.
    table, twin = _local("raise", "adagrad"), _local("raise", "adagrad")
    keys = np.array([4, 4, 9], np.int64)
    grads = np.full((3, DIM), 1e30, np.float32)
    table.push(keys, grads)
    core = _core.Table(core_options(twin._config))
    core.push(keys, grads, twin.optimizer.learning_rate_at(0), 1)
    assert table.iterations == 1
    np.testing.assert_array_equal(table.pull([4, 9], train=False), core.pull(keys[1:], False))


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_finite_gradients_whose_sum_overflows_are_refused(nonfinite: str) -> None:
    """A push sums equal keys in float32: 3e38 + 3e38 is Inf although both are finite."""
    name = _name()
    table = _local(nonfinite, "sgd", name)
    table.push([7, 8], np.ones((2, DIM), np.float32))
    before = _state(table)
    grads = np.zeros((4, DIM), np.float32)
    grads[[0, 2], 1] = 3e38  # key 7, twice
    keys = np.array([7, 8, 7, 9], np.int64)
    if nonfinite == "raise":
        with pytest.raises(ValueError, match=rf"{name!r}: the gradients of 1 of 3 keys sum"):
            table.push(keys, grads)
    else:
        table.push(keys, grads)
        assert table.nonfinite_pushes == 1
    _assert_same_state(_state(table), before)
    # The same values on distinct keys are fine.
    table.push(np.array([7, 8, 10, 9]), grads)
    assert table.iterations == 2


def test_check_finite_gradients() -> None:
    keys = np.array([1, 2], np.int64)
    good = np.ones((2, 3), np.float32)
    bad = good.copy()
    bad[1, 2] = np.inf
    assert check_finite_gradients("t", keys, good, "raise") is True
    assert check_finite_gradients("t", keys, good, "skip") is True
    assert check_finite_gradients("t", keys, bad, "skip") is False
    assert check_finite_gradients("t", keys[:0], np.zeros((0, 3), np.float32), "raise") is True
    with pytest.raises(ValueError, match=r"Table 't': 1 of 6 gradient values are not finite"):
        check_finite_gradients("t", keys, bad, "raise")
    with pytest.raises(ValueError, match=r"one of \('raise', 'skip'\)"):
        check_finite_gradients("t", keys, good, "ignore")
    # Inputs are only read.
    assert np.isinf(bad[1, 2]) and (good == 1).all()


# Replica sums (the in-process StepFusion under a tf.distribute strategy).


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_replica_sum_with_a_non_finite_replica_applies_nothing(nonfinite: str) -> None:
    table, twin = _local(nonfinite, "adam"), _local("raise", "adam")
    fusion = table.step_fusion()
    rng = np.random.default_rng(4)
    keys = np.array([1, 2, 3], np.int64)
    g1, g2 = _grads(rng, 3), _grads(rng, 3)
    fusion.push_gradient(keys, g1, 2)  # waits for the second replica
    assert table.iterations == 0
    if nonfinite == "raise":
        with pytest.raises(ValueError, match="1 of 36 gradient values"):
            fusion.push_gradient(keys, _with_bad(g2, -np.inf, 1), 2)
    else:
        fusion.push_gradient(keys, _with_bad(g2, -np.inf, 1), 2)
        assert table.nonfinite_pushes == 1
    assert len(table) == 0 and table.iterations == 0
    # The next step starts clean: both replicas' gradients, summed once.
    fusion.push_gradient(keys, g1, 2)
    fusion.push_gradient(keys[::-1], g2[::-1], 2)
    twin.push(np.concatenate([keys, keys[::-1]]), np.concatenate([g1, g2[::-1]]))
    _assert_same_state(_state(table), _state(twin))


def test_replica_sum_that_overflows_is_refused() -> None:
    table = _local("raise", "sgd")
    fusion = table.step_fusion()
    big = np.full((1, DIM), 2e38, np.float32)
    fusion.push_gradient(np.array([5]), big, 2)
    with pytest.raises(ValueError, match="sum to values beyond float32's range"):
        fusion.push_gradient(np.array([5]), big, 2)
    assert len(table) == 0 and table.iterations == 0


# Configuration.


def test_config_carries_the_policy_and_old_configs_default_to_raise() -> None:
    config = TableConfig.make(4, "sgd", name="cfg", nonfinite="skip")
    assert config.to_dict()["nonfinite"] == "skip"
    assert TableConfig.from_dict(config.to_dict()) == config
    old = config.to_dict()
    del old["nonfinite"]  # written before the field existed
    assert TableConfig.from_dict(old).nonfinite == "raise"
    assert TableConfig.make(4).nonfinite == "raise"


@pytest.mark.parametrize("value", ["ignore", "", None, 1, "RAISE"])
def test_invalid_policy_is_a_value_error_listing_the_choices(value: Any) -> None:
    with pytest.raises(ValueError, match=r"`nonfinite` must be one of \('raise', 'skip'\)"):
        TableConfig.make(4, nonfinite=value)
    with pytest.raises(ValueError, match=r"`nonfinite` must be one of \('raise', 'skip'\)"):
        ee.Table(4, name=_name(), nonfinite=value)


def test_public_constructor_and_from_config_keep_the_policy() -> None:
    table = ee.Table(4, optimizer="sgd", name=_name(), nonfinite="skip")
    assert isinstance(table, LocalTable) and table.nonfinite == "skip"
    assert table.config()["nonfinite"] == "skip"
    again = ee.Table.from_config(table.config())
    assert again.nonfinite == "skip" and again.config() == table.config()
    again.push([1], np.full((1, 4), np.nan, np.float32))
    assert again.nonfinite_pushes == 1 and len(again) == 0


# Keras.


def _nan_model(layer: Any) -> Any:
    keras = pytest.importorskip("keras")

    class TimesNaN(keras.layers.Layer):
        """Multiplies by NaN: every gradient flowing back through it is NaN."""

        def call(self, x: Any) -> Any:
            return x * float("nan")

    inp = keras.Input((3,), dtype="int64")
    x = keras.layers.Flatten()(TimesNaN()(layer(inp)))
    model = keras.Model(inp, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _ids(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.integers(0, 40, (n, 3)).astype(np.int64), rng.normal(size=(n, 1)).astype(np.float32)


def test_fit_with_nan_gradients_raises_naming_the_table() -> None:
    tf = pytest.importorskip("tensorflow")
    name = _name()
    layer = ee.Embedding(4, optimizer=eo.SGD(0.1), name=name)
    model = _nan_model(layer)
    x, y = _ids()
    # The push's ValueError, through tf.numpy_function. Every value is NaN: "<n> of <n>".
    message = rf"Table {name!r}: (\d+) of \1 gradient values"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message) as info:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert "not finite" in str(info.value)
    assert layer.table.iterations == 0
    np.testing.assert_array_equal(_state(layer.table)["update_count"], 0)


def test_fit_with_nan_gradients_and_skip_trains_on_and_leaves_rows_unchanged() -> None:
    pytest.importorskip("tensorflow")
    name = _name()
    layer = ee.Embedding(4, optimizer=eo.SGD(0.1), name=name, seed=3, nonfinite="skip")
    model = _nan_model(layer)
    x, y = _ids()
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2  # training went on
    assert layer.table.nonfinite_pushes == 2 * 4 and layer.table.iterations == 0
    # The rows are their initial values (a fresh table with the same config, not trained).
    state = _state(layer.table)
    np.testing.assert_array_equal(state["keys"], np.unique(x))
    fresh = LocalTable(TableConfig.from_dict(layer.table.config()))
    assert state["values"].tobytes() == fresh.pull(state["keys"], train=False).tobytes()
    np.testing.assert_array_equal(state["update_count"], 0)


def test_layer_config_round_trip_keeps_the_policy() -> None:
    pytest.importorskip("tensorflow")
    layer = ee.Embedding(4, name=_name(), nonfinite="skip")
    config = layer.get_config()
    assert config["nonfinite"] == "skip" and layer.table.nonfinite == "skip"
    clone = ee.Embedding.from_config(config)
    assert clone.get_config() == config and clone.table.nonfinite == "skip"
    assert ee.Embedding(4, name=_name()).get_config()["nonfinite"] == "raise"
    old = {k: v for k, v in config.items() if k != "nonfinite"}  # saved before the option
    assert ee.Embedding.from_config(old).table.nonfinite == "raise"
    with pytest.raises(ValueError, match=r"`nonfinite` must be one of \('raise', 'skip'\)"):
        ee.Embedding(4, name=_name(), nonfinite="zero")


# GPU tables: gradients given as a GPU array are checked too.


@pytest.mark.gpu
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_gpu_table_refuses_non_finite_device_gradients(nonfinite: str) -> None:
    if not (_core.with_cuda and _core.cuda_device_count() > 0):
        pytest.skip("needs a CUDA build and a visible GPU")
    from elastic_emb.tables import gpu

    name = _name()
    table = ee.Table(DIM, optimizer="adam", name=name, device="gpu", nonfinite=nonfinite)
    table.push([1, 2], np.ones((2, DIM), np.float32))
    before = _state(table)
    host = _with_bad(np.ones((3, DIM), np.float32), np.nan, 2)
    grads = gpu.DeviceArray(host.shape, np.float32)
    _core.copy_to_device(grads.ptr, host)
    if nonfinite == "raise":
        with pytest.raises(ValueError, match=rf"{name!r}: 2 of 18 gradient values"):
            table.push(np.array([1, 2, 3]), grads)
    else:
        table.push(np.array([1, 2, 3]), grads)
        assert table.nonfinite_pushes == 1
    _assert_same_state(_state(table), before)
    _core.copy_to_device(grads.ptr, np.ones((3, DIM), np.float32))
    table.push(np.array([1, 2, 3]), grads)  # finite: applied from the GPU array
    assert table.iterations == 2 and len(table) == 3
