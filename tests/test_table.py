"""Tests of `ee.Table`: pull/push/import/export/erase/metadata, initialization, input checks
and thread safety.

Expected values come from outside the table: functions of the key, exact
integer sums, NumPy references of the optimizers, Keras initializers' own
samples, and a second process.
"""

from __future__ import annotations

import itertools
import textwrap
import threading
import zlib
from pathlib import Path

import keras
import numpy as np
import pytest
from _numpy_reference import ReferenceTable
from _processes import run_python

import elastic_emb as ee
from elastic_emb.tables.policies import optimizers as eo

_names = itertools.count()


def _name(prefix: str = "t") -> str:
    return f"{prefix}_tbl_{next(_names)}"


def _table(dim: int = 4, **kwargs) -> ee.Table:
    kwargs.setdefault("optimizer", eo.SGD(learning_rate=1.0))
    kwargs.setdefault("name", _name())
    return ee.Table(dim=dim, **kwargs)


def _value_of(keys: np.ndarray, dim: int) -> np.ndarray:
    """Row values that are a function of the key (exact in float32)."""
    keys = np.asarray(keys, np.int64)
    col = np.arange(dim, dtype=np.int64)
    return (((keys[:, None] * 7 + col[None, :] * 13) % 2001) - 1000).astype(np.float32) / 8


def _sorted_export(table: ee.Table) -> tuple[np.ndarray, np.ndarray]:
    keys, values = table.export_rows()
    order = np.argsort(keys)
    return keys[order], values[order]


# Pull and deterministic initialization.


def test_pull_train_inserts_and_eval_pull_does_not() -> None:
    t = _table(dim=5, initializer="uniform", seed=11)
    keys = np.array([3, -9, 2**62, 3, 0, 17], np.int64)  # one duplicate
    first = t.pull(keys, train=False)
    assert first.shape == (6, 5) and first.dtype == np.float32
    assert len(t) == 0
    assert t.export_rows()[0].shape == (0,)
    np.testing.assert_array_equal(t.metadata(keys)[0], [-1] * 6)
    again = t.pull(keys, train=False)
    np.testing.assert_array_equal(again, first)
    assert len(t) == 0
    stored = t.pull(keys, train=True)
    np.testing.assert_array_equal(stored, first)
    assert len(t) == 5  # distinct keys
    exp_keys, exp_values = _sorted_export(t)
    np.testing.assert_array_equal(exp_keys, np.unique(keys))
    for k, v in zip(exp_keys, exp_values, strict=True):
        np.testing.assert_array_equal(v, first[np.flatnonzero(keys == k)[0]])
    # The metadata of pulled-but-never-pushed rows is zero, not absent.
    np.testing.assert_array_equal(t.metadata(keys)[1], [0] * 6)
    # A trained row is returned as trained, with or without train.
    t.push(np.array([3]), np.ones((1, 5), np.float32))
    np.testing.assert_array_equal(t.pull(np.array([3]), train=False), first[:1] - 1.0)
    np.testing.assert_array_equal(t.pull(np.array([3]), train=True), first[:1] - 1.0)


def test_pull_accepts_lists_int32_and_non_contiguous_keys() -> None:
    t = _table(dim=3, initializer="normal", seed=5)
    want = t.pull(np.array([4, 6, 8], np.int64), train=False)
    np.testing.assert_array_equal(t.pull([4, 6, 8], train=False), want)
    np.testing.assert_array_equal(t.pull(np.array([4, 6, 8], np.int32), train=False), want)
    strided = np.arange(4, 10, dtype=np.int64)[::2]
    assert not strided.flags.c_contiguous
    np.testing.assert_array_equal(t.pull(strided, train=False), want)
    assert t.pull(np.zeros(0, np.int64)).shape == (0, 3)
    assert len(t) == 0


def test_same_seed_and_key_give_the_same_row_in_any_table_and_batch() -> None:
    a = _table(dim=6, initializer="uniform", seed=42)
    b = _table(dim=6, initializer="uniform", seed=42)
    keys = np.arange(-50, 50, dtype=np.int64)
    rows_a = a.pull(keys, train=True)
    np.testing.assert_array_equal(b.pull(keys[::-1], train=False)[::-1], rows_a)
    # A row does not depend on the batch it is pulled in.
    np.testing.assert_array_equal(b.pull(np.array([7]), train=False)[0], rows_a[57])
    # Different keys and different columns get different values.
    assert len(np.unique(rows_a[:, 0])) == 100
    assert len(np.unique(rows_a[0])) == 6
    # Other seeds give other rows.
    c = _table(dim=6, initializer="uniform", seed=43)
    assert not np.any(c.pull(keys, train=False) == rows_a)


def test_default_seed_derives_from_the_name() -> None:
    name = _name("seeded")
    a = _table(dim=4, initializer="uniform", name=name)
    b = _table(dim=4, initializer="uniform", name=name)  # takes the name over
    other = _table(dim=4, initializer="uniform", name=name + "x")
    assert a.name == b.name == name
    assert ee.placement.registered_tables()[name] is b
    assert a.seed == b.seed == zlib.crc32(name.encode())
    keys = np.arange(20)
    np.testing.assert_array_equal(a.pull(keys, train=False), b.pull(keys, train=False))
    explicit = _table(dim=4, initializer="uniform", seed=zlib.crc32(name.encode()))
    np.testing.assert_array_equal(a.pull(keys, train=False), explicit.pull(keys, train=False))
    assert not np.any(a.pull(keys, train=False) == other.pull(keys, train=False))


def test_initial_values_are_the_same_in_a_fresh_process(tmp_path: Path) -> None:
    keys = np.concatenate([np.arange(-500, 1500), [2**63 - 1, -(2**63), 2**40 + 3]]).astype(
        np.int64
    )
    np.save(tmp_path / "keys.npy", keys)
    specs = [
        ("uniform", 7, None),
        ("normal", 8, None),
        ("truncated_normal", 9, None),
        ("uniform", None, "det_default_seed"),
    ]
    script = f"""
        import numpy as np, elastic_emb as ee
        keys = np.load("keys.npy")
        for i, (init, seed, name) in enumerate({specs!r}):
            t = ee.Table(dim=7, initializer=init, seed=seed, name=name or "sub")
            with open(f"rows{{i}}.bin", "wb") as f:
                f.write(t.pull(keys, train=True).tobytes())
    """
    run_python("-c", textwrap.dedent(script), cwd=tmp_path)
    for i, (init, seed, name) in enumerate(specs):
        t = ee.Table(dim=7, initializer=init, seed=seed, name=name or _name())
        assert t.pull(keys, train=False).tobytes() == (tmp_path / f"rows{i}.bin").read_bytes(), init


# Initializer distributions.

N_KEYS, DIM = 25_000, 8  # 200k values


def _ks_statistic(x: np.ndarray, y: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    x, y = np.sort(x), np.sort(y)
    grid = np.concatenate([x, y])
    cdf_x = np.searchsorted(x, grid, side="right") / x.size
    cdf_y = np.searchsorted(y, grid, side="right") / y.size
    return float(np.max(np.abs(cdf_x - cdf_y)))


@pytest.mark.parametrize(
    ("initializer", "keras_initializer", "low", "high"),
    [
        ("uniform", keras.initializers.RandomUniform(-0.05, 0.05, seed=1), -0.05, 0.05),
        (
            keras.initializers.RandomUniform(-1.0, 3.0),
            keras.initializers.RandomUniform(-1.0, 3.0, seed=1),
            -1.0,
            3.0,
        ),
        ("normal", keras.initializers.RandomNormal(0.0, 0.05, seed=1), None, None),
        (
            keras.initializers.RandomNormal(mean=2.0, stddev=0.5),
            keras.initializers.RandomNormal(2.0, 0.5, seed=1),
            None,
            None,
        ),
        ("truncated_normal", keras.initializers.TruncatedNormal(0.0, 0.05, seed=1), -0.1, 0.1),
        (
            keras.initializers.TruncatedNormal(mean=-1.0, stddev=2.0),
            keras.initializers.TruncatedNormal(-1.0, 2.0, seed=1),
            -5.0,
            3.0,
        ),
    ],
    ids=["uniform", "uniform(-1,3)", "normal", "normal(2,.5)", "truncated", "truncated(-1,2)"],
)
def test_random_initializers_match_the_keras_distribution(
    initializer, keras_initializer, low, high
) -> None:
    t = _table(dim=DIM, initializer=initializer, seed=2024)
    rows = t.pull(np.arange(N_KEYS, dtype=np.int64) * 7919 - 10**6, train=False)
    ours = rows.ravel().astype(np.float64)
    theirs = np.asarray(keras_initializer((N_KEYS, DIM)), np.float64).ravel()
    scale = theirs.std()
    # Moments: the standard error of the mean is std/sqrt(200k) ~ 0.0022 std.
    assert abs(ours.mean() - theirs.mean()) < 0.012 * scale
    assert abs(ours.std() / scale - 1.0) < 0.01
    # Shapes: KS critical value at alpha=1e-4 for 200k vs 200k is ~0.0066.
    assert _ks_statistic(ours, theirs) < 0.0066
    if low is not None:
        assert ours.min() >= low and ours.max() <= high
        # The tails are reached (not a narrower distribution).
        span = high - low
        assert ours.min() < low + 0.01 * span and ours.max() > high - 0.01 * span
    # Columns are identically distributed and uncorrelated; so are neighbouring keys.
    col_means = (rows.mean(axis=0) - theirs.mean()) / scale
    assert np.all(np.abs(col_means) < 0.03)
    assert abs(np.corrcoef(rows[:, 0], rows[:, 1])[0, 1]) < 0.03
    assert abs(np.corrcoef(rows[:-1, 0], rows[1:, 0])[0, 1]) < 0.03


@pytest.mark.parametrize(
    ("initializer", "value"),
    [
        ("zeros", 0.0),
        (keras.initializers.Zeros(), 0.0),
        ("ones", 1.0),
        (keras.initializers.Ones(), 1.0),
        (keras.initializers.Constant(2.5), 2.5),
        (keras.initializers.Constant(-3), -3.0),
    ],
)
def test_constant_initializers(initializer, value: float) -> None:
    t = _table(dim=5, initializer=initializer)
    np.testing.assert_array_equal(
        t.pull(np.arange(-100, 100), train=True), np.full((200, 5), value, np.float32)
    )


def test_constant_by_name_is_zeros_or_a_clear_value_error() -> None:
    """`"constant"` is listed as a name; Keras' own `get("constant")` raises KeyError.

    Either reading is acceptable (Keras' default value 0, or a ValueError naming
    the argument); a stray KeyError is not.
    """
    try:
        t = _table(dim=3, initializer="constant")
    except ValueError as e:
        assert "`embeddings_initializer`" in str(e)
    else:
        np.testing.assert_array_equal(t.pull(np.arange(5), train=True), np.zeros((5, 3)))


@pytest.mark.parametrize(
    "initializer",
    [
        "orthogonal",
        "glorot_uniform",
        "he_normal",
        "identity",
        "no_such_initializer",
        keras.initializers.GlorotUniform(),
        keras.initializers.VarianceScaling(),
        keras.initializers.Constant(np.array([1.0, 2.0])),
        3,
        None,
    ],
    ids=str,
)
def test_unknown_initializer_raises_naming_embeddings_initializer(initializer) -> None:
    with pytest.raises(ValueError, match="`embeddings_initializer`") as info:
        _table(initializer=initializer)
    assert "Received" in str(info.value)


@pytest.mark.parametrize(
    "name",
    [
        "zeros", "zero", "Zeros", "ones", "one", "Ones", "uniform", "random_uniform",
        "RandomUniform", "normal", "random_normal", "RandomNormal", "truncated_normal",
        "TruncatedNormal",
    ],
)  # fmt: skip
def test_initializer_names_resolve_as_keras_resolves_them(name: str) -> None:
    """Names resolve without Keras (initializers._KERAS_NAMES); Keras agrees."""
    assert ee.initializers.get(name) == ee.initializers.get(keras.initializers.get(name))


# Without TensorFlow, Keras and gRPC (e.g. on a GPU machine).

_BLOCK_IMPORTS = """
    import sys

    BLOCKED = ("keras", "tensorflow", "tf_keras", "grpc", "google.protobuf")

    class Block:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Block())
"""


def test_tables_optimizers_and_checkpoints_work_without_tensorflow_and_keras(
    tmp_path: Path,
) -> None:
    keys = np.array([5, -3, 2**40, 5, 77], np.int64)
    grads = np.arange(5 * 4, dtype=np.float32).reshape(5, 4) / 7
    np.save(tmp_path / "keys.npy", keys)
    np.save(tmp_path / "grads.npy", grads)
    script = (
        _BLOCK_IMPORTS
        + """
    import numpy as np

    import elastic_emb as ee
    import elastic_emb.tables.table as T

    keys, grads = np.load("keys.npy"), np.load("grads.npy")
    t = T.Table(dim=4, optimizer="adagrad", name="t")
    assert t.pull(keys).shape == (5, 4)
    t.push(keys, grads)
    u = ee.Table(dim=4, optimizer=ee.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
                 initializer="truncated_normal", seed=3, name="u")
    u.push(keys, grads)
    ee.save("ckpt", tables=[t, u])
    t.push(keys, grads)
    ee.restore("ckpt", tables=[t])
    assert t.iterations == 1
    for table in (t, u):
        with open(f"{table.name}.bin", "wb") as f:
            f.write(table.pull(np.sort(keys), train=False).tobytes())
    info = ee.build_info()
    assert info["tensorflow"] is None and info["keras"] is None, info
    # (ee.init and remote tables need gRPC, not TensorFlow.)
    for name in ("Embedding", "layers", "callbacks", "data", "models", "keras_patches"):
        try:
            getattr(ee, name)
        except ImportError as e:
            assert "TensorFlow" in str(e), e
        else:
            raise AssertionError(f"ee.{name} imported without TensorFlow")
    for name in ("optimizers", "initializers", "sharding", "checkpoint", "CheckpointError",
                 "save", "restore", "_core"):
        getattr(ee, name)
    loaded = [m for m in sys.modules if m.split(".")[0] in ("keras", "tensorflow", "grpc")]
    assert not loaded, loaded
    print("ok")
    """
    )
    out = run_python("-c", textwrap.dedent(script), cwd=tmp_path)
    assert out.strip().endswith("ok"), out
    # The same tables, built with Keras loaded here, give the same bytes.
    t = ee.Table(dim=4, optimizer="adagrad", name=_name(), seed=ee.table.default_seed("t"))
    t.push(keys, grads)
    u = ee.Table(
        dim=4,
        optimizer=eo.Ftrl(0.1, l1_regularization_strength=0.01),
        initializer=keras.initializers.TruncatedNormal(0.0, 0.05),
        seed=3,
        name=_name(),
    )
    u.push(keys, grads)
    for table, name in ((t, "t"), (u, "u")):
        child = (tmp_path / f"{name}.bin").read_bytes()
        assert table.pull(np.sort(keys), train=False).tobytes() == child, name


# Import, export, erase, metadata, size.


def test_import_export_round_trip() -> None:
    t = _table(dim=9, initializer="uniform", seed=3)
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(-(2**62), 2**62, size=3000))
    t.pull(keys[:100], train=True)  # some rows exist before the import
    values = _value_of(keys, 9)
    t.import_rows(keys, values)
    assert len(t) == keys.size
    exp_keys, exp_values = _sorted_export(t)
    np.testing.assert_array_equal(exp_keys, keys)
    np.testing.assert_array_equal(exp_values, values)
    np.testing.assert_array_equal(t.pull(keys, train=False), values)
    # Importing the export into a fresh table reproduces it.
    u = _table(dim=9, initializer="zeros")
    u.import_rows(*t.export_rows())
    np.testing.assert_array_equal(_sorted_export(u)[1], values)
    # float64 values are accepted and converted.
    u.import_rows(keys[:3], values[:3].astype(np.float64) + 1)
    np.testing.assert_array_equal(u.pull(keys[:3], train=False), values[:3] + 1)


def test_import_with_duplicate_keys_keeps_the_last() -> None:
    t = _table(dim=2)
    t.import_rows(np.array([5, 6, 5]), np.array([[1, 1], [2, 2], [3, 3]], np.float32))
    assert len(t) == 2
    np.testing.assert_array_equal(t.pull(np.array([5, 6]), train=False), [[3, 3], [2, 2]])


@pytest.mark.parametrize(
    ("opt", "kind", "hparams"),
    [
        (eo.Adagrad(learning_rate=0.5), "adagrad", {}),
        (
            eo.Adam(learning_rate=0.1, beta_1=0.5, beta_2=0.75),
            "adam",
            {"beta_1": 0.5, "beta_2": 0.75},
        ),
        (eo.SGD(learning_rate=0.5, momentum=0.5), "sgd", {"momentum": 0.5}),
        (
            eo.Ftrl(learning_rate=0.5, l1_regularization_strength=0.01),
            "ftrl",
            {"l1_regularization_strength": 0.01},
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_import_resets_optimizer_slots(opt, kind: str, hparams: dict) -> None:
    dim = 3
    t = _table(dim=dim, optimizer=opt, initializer="zeros")
    ref = ReferenceTable(kind, dim, lambda k: np.zeros(dim, np.float32), **hparams)
    keys = np.array([1, 2, 3])
    rng = np.random.default_rng(1)
    for _ in range(3):
        g = rng.normal(size=(3, dim)).astype(np.float32)
        t.push(keys, g)
        ref.push(keys, g, opt.learning_rate)
    new_values = _value_of(keys[:2], dim)
    t.import_rows(keys[:2], new_values)
    ref.import_rows(keys[:2], new_values)
    np.testing.assert_array_equal(t.metadata(keys)[0], [0, 0, 3])
    np.testing.assert_array_equal(t.metadata(keys)[1], [0, 0, 3])
    g = rng.normal(size=(3, dim)).astype(np.float32)
    t.push(keys, g)
    ref.push(keys, g, opt.learning_rate)
    np.testing.assert_allclose(t.pull(keys, train=False), ref.rows(keys)[0], rtol=2e-6, atol=1e-7)
    # Had the slots been kept, the imported rows would differ from a fresh start.
    fresh = ReferenceTable(kind, dim, lambda k: np.zeros(dim, np.float32), **hparams)
    fresh.import_rows(keys[:2], new_values)
    fresh.iterations = 3
    fresh.push(keys[:2], g[:2], opt.learning_rate)
    np.testing.assert_allclose(
        t.pull(keys[:2], train=False), fresh.rows(keys[:2])[0], rtol=2e-6, atol=1e-7
    )


def test_erase_removes_rows_and_reinsertion_starts_fresh() -> None:
    dim = 4
    t = _table(dim=dim, optimizer=eo.Adagrad(learning_rate=0.5), initializer="uniform", seed=8)
    keys = np.arange(10, 20)
    init = t.pull(keys, train=True)
    t.push(keys, np.ones((10, dim), np.float32))
    assert t.erase(np.array([10, 11, 11, 999])) == 2  # duplicates and absent keys not counted
    assert t.erase(np.array([10])) == 0
    assert len(t) == 8
    assert set(t.export_rows()[0].tolist()) == set(range(12, 20))
    np.testing.assert_array_equal(t.metadata(np.array([10, 11, 12]))[0], [-1, -1, 1])
    np.testing.assert_array_equal(t.pull(np.array([10, 11]), train=False), init[:2])
    np.testing.assert_array_equal(t.pull(np.array([10, 11]), train=True), init[:2])
    assert len(t) == 10
    # Re-inserted rows have fresh slots: the next push equals a first push.
    ref = ReferenceTable("adagrad", dim, lambda k: init[k - 10])
    g = np.full((2, dim), 2.0, np.float32)
    t.push(np.array([10, 11]), g)
    ref.push(np.array([10, 11]), g, 0.5)
    np.testing.assert_array_equal(t.pull(np.array([10, 11]), train=False), ref.rows([10, 11])[0])


def test_erase_many_keeps_every_other_key_reachable() -> None:
    """Deletion in the open-addressing index must not lose keys of the same probe run."""
    dim = 2
    t = _table(dim=dim, initializer="zeros")
    rng = np.random.default_rng(7)
    keys = np.unique(rng.integers(-(10**12), 10**12, size=30_000))
    t.import_rows(keys, _value_of(keys, dim))
    for round_ in range(3):
        gone = keys[round_::3]
        assert t.erase(gone) == gone.size
        kept = np.setdiff1d(keys, gone)
        assert len(t) == kept.size
        np.testing.assert_array_equal(t.pull(kept, train=False), _value_of(kept, dim))
        np.testing.assert_array_equal(t.pull(gone, train=False), np.zeros((gone.size, dim)))
        np.testing.assert_array_equal(t.metadata(gone)[0], np.full(gone.size, -1))
        exp_keys, exp_values = _sorted_export(t)
        np.testing.assert_array_equal(exp_keys, kept)
        np.testing.assert_array_equal(exp_values, _value_of(kept, dim))
        # Put them back with other values (freed rows are reused).
        t.import_rows(gone, _value_of(gone, dim) + 1)
        assert len(t) == keys.size
        np.testing.assert_array_equal(t.pull(gone, train=False), _value_of(gone, dim) + 1)
        np.testing.assert_array_equal(t.pull(kept, train=False), _value_of(kept, dim))
        t.import_rows(gone, _value_of(gone, dim))


def test_len_and_memory_bytes_grow() -> None:
    dim = 8
    t = _table(dim=dim, optimizer=eo.Adam(learning_rate=0.1))
    sizes = [t.memory_bytes()]
    assert sizes[0] > 0 and len(t) == 0
    for n in (1_000, 10_000, 50_000):
        t.pull(np.arange(n), train=True)
        assert len(t) == n
        sizes.append(t.memory_bytes())
    assert sizes == sorted(sizes) and sizes[-1] > sizes[1] > sizes[0]
    # Value and two Adam slots of 8 floats per row at least.
    assert sizes[-1] >= 50_000 * 3 * dim * 4


def test_metadata_tracks_last_step_and_update_count() -> None:
    t = _table(dim=2)
    pushes = [[1, 2, 2], [2, 3], [1], [4, 4, 4]]
    for keys in pushes:
        t.push(np.array(keys), np.ones((len(keys), 2), np.float32))
    assert t.iterations == 4
    query = np.array([1, 2, 3, 4, 5, 2])
    last_step, count = t.metadata(query)
    assert last_step.dtype == np.int64 and count.dtype == np.int64
    np.testing.assert_array_equal(last_step, [3, 2, 2, 4, -1, 2])
    np.testing.assert_array_equal(count, [2, 2, 1, 1, -1, 2])
    # Values: duplicates within a push are summed (SGD, lr=1, zero initial rows).
    u = _table(dim=2, initializer="zeros")
    for keys in pushes:
        u.push(np.array(keys), np.ones((len(keys), 2), np.float32))
    np.testing.assert_array_equal(
        u.pull(np.array([1, 2, 3, 4]), train=False)[:, 0], [-2, -3, -1, -3]
    )


# Bad input.

BAD_PULL_KEYS = [
    (np.array([1.0, 2.0]), "dtype=float64"),
    (np.array([1.5], np.float32), "dtype=float32"),
    (np.array(["a", "b"]), "dtype=<U1"),
    (np.array([True, False]), "dtype=bool"),
    (np.array([[1, 2], [3, 4]], np.int64), "shape=(2, 2)"),
    (np.int64(3), "shape=()"),
    ([1, "x"], "dtype=<U21"),
]


def _snapshot(t: ee.Table):
    st = t.export_state()
    order = np.argsort(st.keys)
    return (
        st.keys[order],
        st.values[order],
        st.slots[order],
        st.last_step[order],
        st.update_count[order],
        st.iterations,
        len(t),
    )


def _assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def filled() -> ee.Table:
    t = _table(dim=3, optimizer=eo.Adagrad(learning_rate=0.1), initializer="uniform", seed=1)
    t.pull(np.arange(10), train=True)
    t.push(np.arange(5), np.ones((5, 3), np.float32))
    return t


@pytest.mark.parametrize(("keys", "needle"), BAD_PULL_KEYS, ids=[n for _, n in BAD_PULL_KEYS])
@pytest.mark.parametrize(
    "method", ["pull", "pull_eval", "push", "import_rows", "erase", "metadata"]
)
def test_bad_keys_raise_naming_keys_and_leave_table_unchanged(filled, method, keys, needle):
    before = _snapshot(filled)
    n = np.asarray(keys).size if np.asarray(keys).ndim else 1
    rows = np.ones((n, 3), np.float32)
    call = {
        "pull": lambda: filled.pull(keys, train=True),
        "pull_eval": lambda: filled.pull(keys, train=False),
        "push": lambda: filled.push(keys, rows),
        "import_rows": lambda: filled.import_rows(keys, rows),
        "erase": lambda: filled.erase(keys),
        "metadata": lambda: filled.metadata(keys),
    }[method]
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "`keys`" in message and needle in message, message
    _assert_same(_snapshot(filled), before)


BAD_ROWS = [
    (np.ones((3, 3), np.int64), "dtype=int64"),
    (np.ones((3, 3), np.int32), "dtype=int32"),
    (np.array([["a"] * 3] * 3), "dtype=<U1"),
    (np.ones((3, 4), np.float32), "shape=(3, 4)"),
    (np.ones((3, 2), np.float32), "shape=(3, 2)"),
    (np.ones((2, 3), np.float32), "shape=(2, 3)"),
    (np.ones((4, 3), np.float32), "shape=(4, 3)"),
    (np.ones((9,), np.float32), "shape=(9,)"),
    (np.ones((3, 3, 1), np.float32), "shape=(3, 3, 1)"),
]


@pytest.mark.parametrize(("rows", "needle"), BAD_ROWS, ids=[n for _, n in BAD_ROWS])
@pytest.mark.parametrize(("method", "arg"), [("push", "grads"), ("import_rows", "values")])
def test_bad_rows_raise_naming_the_argument_and_leave_table_unchanged(
    filled, method, arg, rows, needle
):
    before = _snapshot(filled)
    keys = np.array([1, 2, 30])
    with pytest.raises(ValueError) as info:
        getattr(filled, method)(keys, rows)
    message = str(info.value)
    assert f"`{arg}`" in message and needle in message, message
    _assert_same(_snapshot(filled), before)
    assert len(filled) == 10  # key 30 was not inserted


@pytest.mark.parametrize(
    ("kwargs", "arg", "value"),
    [
        ({"dim": 0}, "dim", 0),
        ({"dim": -1}, "dim", -1),
        ({"dim": "3"}, "dim", "3"),
        ({"dim": 2.0}, "dim", 2.0),
        ({"dim": True}, "dim", True),
        ({"dim": None}, "dim", None),
        ({"dim": 4, "name": ""}, "name", ""),
        ({"dim": 4, "name": None}, "name", None),
        ({"dim": 4, "name": 5}, "name", 5),
        ({"dim": 4, "seed": -1}, "seed", -1),
        ({"dim": 4, "seed": "1"}, "seed", "1"),
        ({"dim": 4, "seed": 1.5}, "seed", 1.5),
    ],
)
def test_invalid_constructor_arguments_raise(kwargs, arg, value) -> None:
    with pytest.raises(ValueError) as info:
        ee.Table(**kwargs)
    message = str(info.value)
    assert f"`{arg}`" in message and f"{arg}={value!r}" in message, message


def test_invalid_optimizer_argument_raises() -> None:
    with pytest.raises(ValueError, match="`optimizer`"):
        _table(optimizer="adadelta")
    with pytest.raises(ValueError, match="Adadelta"):
        _table(optimizer=keras.optimizers.Adadelta())


# Concurrency and large batches.


def _run_threads(fns) -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in fns]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "threads hung"
    if errors:
        raise errors[0]


def test_concurrent_pushes_give_exact_sums() -> None:
    dim, threads, pushes = 4, 8, 25
    t = _table(dim=dim, optimizer=eo.SGD(learning_rate=1.0), initializer="zeros")
    shared = np.arange(64, dtype=np.int64)
    big_extra = np.arange(10_000, 16_000, dtype=np.int64)  # >= 4096: the thread pool runs

    def keys_of(tid: int) -> np.ndarray:
        base = np.concatenate([shared, shared[:8]])  # duplicates inside each push
        return np.concatenate([base, big_extra]) if tid < 2 else base

    def grads_of(tid: int, i: int, n: int) -> np.ndarray:
        return np.full((n, dim), float(tid + 1 + i % 3), np.float32)

    def worker(tid: int):
        def run():
            for i in range(pushes):
                k = keys_of(tid)
                t.push(k, grads_of(tid, i, k.size))

        return run

    _run_threads([worker(tid) for tid in range(threads)])
    assert t.iterations == threads * pushes
    expected = {}
    for tid in range(threads):
        for i in range(pushes):
            k = keys_of(tid)
            g = grads_of(tid, i, k.size)[:, 0]
            for key, gv in zip(k.tolist(), g.tolist(), strict=True):
                expected[key] = expected.get(key, 0.0) - gv
    keys = np.array(sorted(expected), np.int64)
    want = np.repeat(np.array([expected[k] for k in keys.tolist()], np.float32)[:, None], dim, 1)
    np.testing.assert_array_equal(t.pull(keys, train=False), want)
    last_step, count = t.metadata(keys)
    np.testing.assert_array_equal(count[: shared.size], threads * pushes)
    np.testing.assert_array_equal(count[shared.size :], 2 * pushes)
    np.testing.assert_array_equal(last_step[: shared.size], threads * pushes)
    assert len(t) == keys.size


def test_concurrent_inserting_pulls_insert_each_key_once() -> None:
    dim = 5
    t = _table(dim=dim, initializer="normal", seed=77)
    twin = _table(dim=dim, initializer="normal", seed=77)
    batches = []
    for tid in range(8):
        start = tid * 3000
        if tid % 2 == 0:  # large, overlapping batches (thread pool)
            batches.append([np.arange(start, start + 6000)])
        else:  # many small batches over the same range
            batches.append([np.arange(s, s + 37) for s in range(start, start + 6000, 37)])
    results: dict[int, list] = {}

    def worker(tid: int):
        def run():
            results[tid] = [t.pull(b, train=True) for b in batches[tid]]

        return run

    _run_threads([worker(tid) for tid in range(8)])
    union = np.unique(np.concatenate([np.concatenate(b) for b in batches]))
    assert len(t) == union.size
    exp_keys, exp_values = _sorted_export(t)
    np.testing.assert_array_equal(exp_keys, union)  # each key exactly once
    np.testing.assert_array_equal(exp_values, twin.pull(union, train=False))
    for tid in range(8):
        for b, rows in zip(batches[tid], results[tid], strict=True):
            np.testing.assert_array_equal(rows, twin.pull(b, train=False))


def test_concurrent_pulls_during_pushes_never_see_torn_rows() -> None:
    dim = 16
    t = _table(dim=dim, optimizer=eo.SGD(learning_rate=1.0), initializer="zeros")
    keys = np.arange(5000, dtype=np.int64)
    t.pull(keys, train=True)
    pushes = 30
    stop = threading.Event()
    seen: list[np.ndarray] = []

    def pusher():
        for _ in range(pushes):
            t.push(keys, np.ones((keys.size, dim), np.float32))
        stop.set()

    def reader():
        while not stop.is_set():
            rows = t.pull(keys, train=False)
            assert np.all(rows == rows[:, :1]), "a row was read while half updated"
            seen.append(rows[:, 0].copy())

    _run_threads([pusher, reader, reader])
    for col in seen:
        assert np.all((col <= 0) & (col >= -pushes) & (col == np.round(col)))
    np.testing.assert_array_equal(t.pull(keys, train=False), np.full((5000, dim), -pushes))


def test_one_large_pull_equals_pulls_in_chunks() -> None:
    dim = 6
    rng = np.random.default_rng(11)
    keys = rng.integers(-(2**40), 2**40, size=100_000)
    keys[::10] = keys[5]  # many duplicates
    a = _table(dim=dim, initializer="uniform", seed=3)
    b = _table(dim=dim, initializer="uniform", seed=3)
    big = a.pull(keys, train=True)
    chunks = np.concatenate(
        [b.pull(keys[i : i + 1000], train=True) for i in range(0, keys.size, 1000)]
    )
    np.testing.assert_array_equal(big, chunks)
    assert len(a) == len(b) == np.unique(keys).size
    _assert_same(_sorted_export(a), _sorted_export(b))
    # Same for a large push of distinct keys against chunked pushes (Adagrad is
    # step-independent and each key is updated once either way).
    c = _table(dim=dim, optimizer=eo.Adagrad(0.1), initializer="uniform", seed=3)
    d = _table(dim=dim, optimizer=eo.Adagrad(0.1), initializer="uniform", seed=3)
    uniq = rng.permutation(np.unique(keys))[:50_000]
    grads = rng.normal(size=(uniq.size, dim)).astype(np.float32)
    c.push(uniq, grads)
    for i in range(0, uniq.size, 2000):
        d.push(uniq[i : i + 2000], grads[i : i + 2000])
    np.testing.assert_array_equal(c.pull(uniq, train=False), d.pull(uniq, train=False))
    ref = ReferenceTable("adagrad", dim, lambda k: None)
    sample = uniq[:50]
    init = a.pull(sample, train=False)
    ref.init = lambda k: init[int(np.flatnonzero(sample == k)[0])]
    ref.push(sample, grads[:50], 0.1)
    np.testing.assert_allclose(c.pull(sample, train=False), ref.rows(sample)[0], rtol=1e-6)
