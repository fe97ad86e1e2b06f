"""Tests of the GPU table: `Table(..., device="gpu")`, an `elastic_emb.tables.gpu.GpuTable`.

The CPU table is the reference: the same seeded pulls and pushes run on both,
and pulled values and exported states must agree (floats to rtol 1e-6, the
rest exactly). The kernel-only hooks (`gather_rows`, `apply_rows`) are checked
against NumPy.

Nothing here imports TensorFlow or Keras: the GPU machine has neither. Every
test is marked `gpu` and the module skips unless `elastic_emb._core` was built
with CUDA (ELASTIC_EMB_CUDA=1) and sees a device. Device-array tests also need
CuPy and skip without it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _numpy_reference import adagrad_update

from elastic_emb import _core
from elastic_emb.persistence import checkpoint as ckpt
from elastic_emb.placement import unregister
from elastic_emb.tables.policies import optimizers as eo
from elastic_emb.tables.table import Table, TableState

pytestmark = pytest.mark.gpu


def _cuda_devices() -> int:
    if not getattr(_core, "with_cuda", False):
        return 0
    try:
        return int(getattr(_core, "cuda_device_count", lambda: 0)())
    except Exception:  # a CUDA build on a machine without a driver
        return 0


if not getattr(_core, "with_cuda", False):
    pytest.skip(
        "elastic_emb._core was built without CUDA (build with ELASTIC_EMB_CUDA=1)",
        allow_module_level=True,
    )
if _cuda_devices() == 0:
    pytest.skip("no CUDA device visible", allow_module_level=True)

from elastic_emb.tables import gpu  # noqa: E402 - needs the CUDA build checked above

try:
    import cupy
except ImportError:  # pragma: no cover - depends on the machine
    cupy = None

needs_cupy = pytest.mark.skipif(cupy is None, reason="CuPy is not installed")

RTOL = 1e-6
DIMS = [1, 2, 3, 4, 5, 7, 8, 16, 31, 33, 64, 127, 128, 257]

# name -> (optimizer factory, initializer): each optimizer also covers one
# initializer, so the GPU's initial values are compared too.
OPTIMIZERS: dict[str, tuple[Any, str]] = {
    "sgd": (lambda: eo.SGD(learning_rate=0.1), "uniform"),
    "sgd_momentum": (lambda: eo.SGD(learning_rate=0.05, momentum=0.9), "normal"),
    "sgd_nesterov": (
        lambda: eo.SGD(learning_rate=0.05, momentum=0.8, nesterov=True),
        "truncated_normal",
    ),
    "adagrad": (lambda: eo.Adagrad(learning_rate=0.1, initial_accumulator_value=0.2), "uniform"),
    "adam": (lambda: eo.Adam(learning_rate=0.01, beta_1=0.85, beta_2=0.99), "normal"),
    "ftrl": (
        lambda: eo.Ftrl(
            learning_rate=0.2,
            learning_rate_power=-0.5,
            initial_accumulator_value=0.1,
            l1_regularization_strength=0.01,
            l2_regularization_strength=0.02,
            l2_shrinkage_regularization_strength=0.03,
            beta=0.1,
        ),
        "truncated_normal",
    ),
}

_names = itertools.count()


def _name(prefix: str = "g") -> str:
    return f"{prefix}_gpu_{next(_names)}"


def _pair(dim: int, opt: str = "adagrad", initializer: str = "uniform", seed: int = 7):
    """(CPU table, GPU table) with the same configuration."""
    make_opt = OPTIMIZERS[opt][0]
    cpu = Table(dim, optimizer=make_opt(), initializer=initializer, name=_name("cpu"), seed=seed)
    dev = Table(
        dim,
        optimizer=make_opt(),
        initializer=initializer,
        name=_name("dev"),
        seed=seed,
        device="gpu",
    )
    return cpu, dev


def _sorted_state(table: Table) -> TableState:
    state = table.export_state()
    return state.select(np.argsort(state.keys, kind="stable"))


def _assert_same_state(a: TableState, b: TableState, *, exact: bool = False) -> None:
    np.testing.assert_array_equal(a.keys, b.keys)
    for field in ("values", "slots"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.shape == y.shape and x.dtype == y.dtype == np.float32, field
        if exact:
            np.testing.assert_array_equal(x, y, err_msg=field)
        else:
            np.testing.assert_allclose(x, y, rtol=RTOL, atol=0, err_msg=field)
    for field in ("last_step", "update_count"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert a.iterations == b.iterations


def _distinct_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    keys = np.unique(rng.integers(-(2**62), 2**62, size=n + 64))
    return rng.permutation(keys)[:n]


def _workload(table: Table, dim: int, seed: int, steps: int = 3, batch: int = 1000) -> list:
    """A seeded sequence of pulls and pushes; returns every pulled array.

    Pushes carry duplicate keys and keys never pulled; train=False pulls ask for
    keys never inserted.
    """
    rng = np.random.default_rng(seed)
    pool = _distinct_keys(rng, steps * batch + batch + steps * 200)
    pulled_pool = pool[: steps * batch]
    unseen = pool[steps * batch : steps * batch + batch]  # never inserted
    push_only = pool[steps * batch + batch :]  # first seen in a push
    out = []
    for step in range(steps):
        keys = rng.choice(pulled_pool[: (step + 1) * batch], size=batch)  # with repeats
        out.append(table.pull(keys, train=True))
        out.append(table.pull(rng.choice(unseen, size=batch // 4), train=False))
        push_keys = np.concatenate(
            [
                keys[: batch // 2],
                rng.choice(keys, size=batch // 4),  # more repeats
                push_only[step * 200 : (step + 1) * 200],
            ]
        )
        rng.shuffle(push_keys)
        grads = (rng.standard_normal((push_keys.size, dim)) * 0.5).astype(np.float32)
        table.push(push_keys, grads)
        out.append(table.pull(keys, train=False))
        out.append(table.pull(push_only[: (step + 1) * 200], train=False))
    return out


# Construction.


def test_device_gpu_gives_a_gpu_table() -> None:
    import elastic_emb as ee

    t = ee.Table(4, optimizer="adagrad", name=_name(), device="gpu")
    assert isinstance(t, gpu.GpuTable) and isinstance(t, Table)
    assert len(t) == 0 and t.iterations == 0
    assert t.dim == 4
    config = t.config()
    assert config["dim"] == 4 and config["optimizer"]["class_name"] == "Adagrad"
    assert t.memory_bytes() >= 0


# Parity with the CPU table.


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_pulls_pushes_and_state_match_the_cpu_table(opt: str, dim: int) -> None:
    cpu, dev = _pair(dim, opt, OPTIMIZERS[opt][1], seed=dim)
    seed = 1000 * dim + list(OPTIMIZERS).index(opt)
    ours, theirs = _workload(dev, dim, seed), _workload(cpu, dim, seed)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == b.shape, i
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=0, err_msg=f"pull #{i}")
    assert len(dev) == len(cpu)
    assert dev.iterations == cpu.iterations == 3
    _assert_same_state(_sorted_state(dev), _sorted_state(cpu))


@pytest.mark.parametrize("opt", ["adagrad", "adam"])
def test_the_layers_fused_path_matches_the_cpu_table(opt: str) -> None:
    # What ee.Embedding calls (no TensorFlow needed): ids with duplicates in,
    # one row per id out; gradients summed per id in C++, then one step.
    cpu, dev = _pair(16, opt, OPTIMIZERS[opt][1], seed=11)
    rng = np.random.default_rng(12)
    for step in range(4):
        keys = np.minimum(rng.zipf(1.3, 2000), 5000).astype(np.int64)
        grads = rng.normal(size=(len(keys), 16)).astype(np.float32)
        rows = [t.step_fusion().lookup(keys, True, True) for t in (dev, cpu)]
        np.testing.assert_allclose(rows[0], rows[1], rtol=RTOL, atol=0, err_msg=f"step {step}")
        for t in (dev, cpu):
            t.step_fusion().push_gradient(keys, grads, 1)
    assert dev.iterations == cpu.iterations == 4
    _assert_same_state(_sorted_state(dev), _sorted_state(cpu))


@pytest.mark.parametrize("initializer", ["zeros", "ones", "uniform", "normal", "truncated_normal"])
@pytest.mark.parametrize("dim", [1, 3, 16, 33, 257])
def test_initial_values_match_the_cpu_table(initializer: str, dim: int) -> None:
    cpu, dev = _pair(dim, "sgd", initializer, seed=123)
    keys = _distinct_keys(np.random.default_rng(dim), 3000)
    np.testing.assert_allclose(
        dev.pull(keys, train=False), cpu.pull(keys, train=False), rtol=RTOL, atol=0
    )
    assert len(dev) == 0
    np.testing.assert_allclose(
        dev.pull(keys, train=True), cpu.pull(keys, train=True), rtol=RTOL, atol=0
    )
    assert len(dev) == len(cpu) == keys.size


def test_import_erase_metadata_and_len_match_the_cpu_table() -> None:
    dim = 6
    cpu, dev = _pair(dim, "adam", "uniform")
    rng = np.random.default_rng(3)
    keys = _distinct_keys(rng, 2000)
    dup = np.concatenate([keys, keys[:100]])  # the last of equal keys wins
    values = rng.standard_normal((dup.size, dim)).astype(np.float32)
    for t in (cpu, dev):
        t.import_rows(dup, values)
        t.push(keys[::3], np.ones((keys[::3].size, dim), np.float32))
        assert t.erase(np.concatenate([keys[:50], keys[:10], [12345678]])) == 50
    assert len(dev) == len(cpu) == keys.size - 50
    probe = np.concatenate([keys[:60], keys[-60:], [12345678]])
    for a, b in zip(dev.metadata(probe), cpu.metadata(probe), strict=True):
        np.testing.assert_array_equal(a, b)
    k_dev, v_dev = dev.export_rows()
    k_cpu, v_cpu = cpu.export_rows()
    np.testing.assert_array_equal(np.sort(k_dev), np.sort(k_cpu))
    np.testing.assert_allclose(
        v_dev[np.argsort(k_dev)], v_cpu[np.argsort(k_cpu)], rtol=RTOL, atol=0
    )
    _assert_same_state(_sorted_state(dev), _sorted_state(cpu))
    assert dev.memory_bytes() > 0


def test_load_state_round_trips_between_cpu_and_gpu() -> None:
    dim = 9
    cpu, dev = _pair(dim, "ftrl", "normal")
    _workload(cpu, dim, seed=5, steps=2, batch=500)
    dev.load_state(cpu.export_state())
    _assert_same_state(_sorted_state(dev), _sorted_state(cpu), exact=True)
    # Training continues identically from the loaded state.
    a, b = (
        _workload(dev, dim, seed=6, steps=2, batch=500),
        _workload(cpu, dim, seed=6, steps=2, batch=500),
    )
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=0)
    _assert_same_state(_sorted_state(dev), _sorted_state(cpu))


# Checkpoints.


@pytest.mark.parametrize("opt", ["sgd_momentum", "adam", "ftrl"])
def test_checkpoint_from_gpu_restores_into_cpu_and_back(opt: str, tmp_path: Path) -> None:
    dim = 17
    make_opt, init = OPTIMIZERS[opt]
    name = _name("ck")
    dev = Table(dim, optimizer=make_opt(), initializer=init, name=name, seed=3, device="gpu")
    _workload(dev, dim, seed=11, steps=2, batch=700)
    expected = _sorted_state(dev)
    ckpt.save(tmp_path / "from_gpu", tables=[dev])
    unregister(dev)  # frees the name for the CPU table
    cpu = Table(dim, optimizer=make_opt(), initializer=init, name=name, seed=3)
    assert cpu.name == name
    ckpt.restore(tmp_path / "from_gpu", tables=[cpu])
    _assert_same_state(_sorted_state(cpu), expected, exact=True)

    # The reverse: trained further on the CPU, saved, restored into a GPU table.
    _workload(cpu, dim, seed=12, steps=1, batch=700)
    expected = _sorted_state(cpu)
    ckpt.save(tmp_path / "from_cpu", tables=[cpu])
    unregister(cpu)
    dev2 = Table(dim, optimizer=make_opt(), initializer=init, name=name, seed=3, device="gpu")
    assert dev2.name == name
    ckpt.restore(tmp_path / "from_cpu", tables=[dev2])
    _assert_same_state(_sorted_state(dev2), expected, exact=True)


# Device arrays (CuPy).


@needs_cupy
@pytest.mark.parametrize("dim", [1, 8, 33, 128])
def test_cupy_keys_and_grads_give_the_numpy_result(dim: int) -> None:
    _, a = _pair(dim, "adam", "uniform", seed=2)
    _, b = _pair(dim, "adam", "uniform", seed=2)
    rng = np.random.default_rng(dim)
    keys = _distinct_keys(rng, 1500)
    for step in range(3):
        push_keys = rng.choice(keys, size=2000)  # repeats, and keys never pulled
        grads = rng.standard_normal((push_keys.size, dim)).astype(np.float32)
        a.push(push_keys, grads)
        b.push(cupy.asarray(push_keys), cupy.asarray(grads))
        assert b.iterations == step + 1
    _assert_same_state(_sorted_state(b), _sorted_state(a), exact=True)


class _CudaArrayInterfaceOnly:
    """A device array seen only through `__cuda_array_interface__`."""

    def __init__(self, array: Any) -> None:
        self._array = array  # keeps the memory alive
        self.__cuda_array_interface__ = array.__cuda_array_interface__


class _DLPackOnly:
    """A device array seen only through `__dlpack__`."""

    def __init__(self, array: Any) -> None:
        self._array = array

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()


@needs_cupy
@pytest.mark.parametrize("wrap", [_CudaArrayInterfaceOnly, _DLPackOnly], ids=lambda w: w.__name__)
def test_any_device_array_protocol_is_accepted(wrap: Any) -> None:
    dim = 5
    _, a = _pair(dim, "adagrad", seed=4)
    _, b = _pair(dim, "adagrad", seed=4)
    rng = np.random.default_rng(9)
    keys = rng.integers(0, 300, size=1000)
    grads = rng.standard_normal((keys.size, dim)).astype(np.float32)
    a.push(keys, grads)
    b.push(wrap(cupy.asarray(keys)), wrap(cupy.asarray(grads)))
    _assert_same_state(_sorted_state(b), _sorted_state(a), exact=True)


@needs_cupy
@pytest.mark.parametrize("dim", [1, 7, 64, 257])
def test_device_output_equals_the_numpy_pull(dim: int) -> None:
    _, t = _pair(dim, "sgd_momentum", "normal", seed=dim)
    rng = np.random.default_rng(dim)
    keys = _distinct_keys(rng, 2000)
    t.pull(keys[:1000], train=True)
    probe = np.concatenate([keys, keys[:300]])  # present, absent and repeated keys
    expected = t.pull(probe, train=False)
    assert len(t) == 1000
    out = t.pull(probe, train=False, device_output=True)
    assert isinstance(out, gpu.DeviceArray)
    assert len(t) == 1000  # train=False inserted nothing
    assert tuple(out.shape) == (probe.size, dim)
    assert np.dtype(out.dtype) == np.float32
    assert out.__dlpack_device__()[0] == 2  # kDLCUDA
    assert out.__cuda_array_interface__["shape"] == (probe.size, dim)
    np.testing.assert_array_equal(out.numpy(), expected)
    np.testing.assert_array_equal(cupy.asnumpy(cupy.from_dlpack(out)), expected)
    np.testing.assert_array_equal(cupy.asnumpy(cupy.asarray(out)), expected)
    # A training pull to the device inserts, like the host one.
    trained = t.pull(probe, train=True, device_output=True)
    np.testing.assert_array_equal(cupy.asnumpy(cupy.asarray(trained)), expected)
    assert len(t) == 2000
    # Device outputs feed pushes directly.
    _, ref = _pair(dim, "sgd_momentum", "normal", seed=dim)
    ref.load_state(t.export_state())
    t.push(cupy.asarray(probe), out)
    ref.push(probe, expected)
    _assert_same_state(_sorted_state(t), _sorted_state(ref), exact=True)


# Errors.


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda t: t.pull(np.array([1.5, 2.0])), "`keys`"),
        (lambda t: t.pull(np.zeros((2, 2), np.int64)), "`keys`"),
        (lambda t: t.push(np.array([1.0, 2.0]), np.zeros((2, 4), np.float32)), "`keys`"),
        (lambda t: t.push(np.array([1, 2]), np.zeros((2, 5), np.float32)), "`grads`"),
        (lambda t: t.push(np.array([1, 2]), np.zeros((3, 4), np.float32)), "`grads`"),
        (lambda t: t.push(np.array([1, 2]), np.zeros(8, np.float32)), "`grads`"),
        (lambda t: t.push(np.array([1, 2]), np.zeros((2, 4), np.int32)), "`grads`"),
        (lambda t: t.import_rows(np.array([1, 2]), np.zeros((2, 3), np.float32)), "`values`"),
    ],
)
def test_bad_host_arguments_raise_naming_the_argument(call: Any, needle: str) -> None:
    cpu, dev = _pair(4, "adagrad")
    for t in (cpu, dev):
        t.pull(np.arange(10), train=True)
        with pytest.raises(ValueError, match=needle):
            call(t)
    _assert_same_state(_sorted_state(dev), _sorted_state(cpu), exact=True)


@needs_cupy
def test_bad_device_arguments_raise_naming_the_argument() -> None:
    t = Table(4, optimizer="adagrad", name=_name(), device="gpu")
    t.pull(np.arange(10), train=True)
    before = _sorted_state(t)
    keys = cupy.arange(2, dtype=cupy.int64)
    with pytest.raises(ValueError, match="`keys`"):
        t.push(cupy.asarray([1.0, 2.0], dtype=cupy.float32), cupy.zeros((2, 4), cupy.float32))
    with pytest.raises(ValueError, match="`keys`"):
        t.push(cupy.zeros((2, 2), cupy.int64), cupy.zeros((2, 4), cupy.float32))
    with pytest.raises(ValueError, match="`grads`"):
        t.push(keys, cupy.zeros((2, 4), cupy.int32))
    with pytest.raises(ValueError, match="`grads`"):
        t.push(keys, cupy.zeros((2, 5), cupy.float32))
    with pytest.raises(ValueError, match="`grads`"):
        t.push(keys, cupy.zeros((3, 4), cupy.float32))
    rows = cupy.arange(4, dtype=cupy.uint32)
    out = cupy.zeros((4, 4), cupy.float32)
    with pytest.raises(ValueError, match="`rows`"):
        t.gather_rows(cupy.arange(4, dtype=cupy.int64), out)
    with pytest.raises(ValueError, match="`out`"):
        t.gather_rows(rows, cupy.zeros((4, 5), cupy.float32))
    with pytest.raises(ValueError, match="`out`"):
        t.gather_rows(rows, cupy.zeros((4, 4), cupy.float64))
    with pytest.raises(ValueError, match="`rows`"):
        t.apply_rows(cupy.arange(4, dtype=cupy.int32), out, 0.1, 1)
    with pytest.raises(ValueError, match="`grads`"):
        t.apply_rows(rows, cupy.zeros((3, 4), cupy.float32), 0.1, 1)
    t.synchronize()
    _assert_same_state(_sorted_state(t), before, exact=True)


def test_impossible_allocation_raises_and_the_table_keeps_working() -> None:
    dim = 1024
    cpu, dev = _pair(dim, "adam", "uniform")
    keys = np.arange(100)
    for t in (cpu, dev):
        t.push(keys, np.ones((keys.size, dim), np.float32))
    # 2^31 rows of (1 + 2 slots) * 1024 floats: 26 TB.
    with pytest.raises((MemoryError, RuntimeError)) as info:
        dev.reserve(2**31)
    assert any(s in str(info.value).lower() for s in ("cuda", "out of memory")), info.value
    # More rows than row ids can count: some clear Python exception.
    with pytest.raises((MemoryError, RuntimeError, ValueError, OverflowError)):
        dev.reserve(10**13)
    more = np.arange(50, 300)
    for t in (cpu, dev):
        t.push(more, np.full((more.size, dim), 0.5, np.float32))
    np.testing.assert_allclose(dev.pull(more), cpu.pull(more), rtol=RTOL, atol=0)
    _assert_same_state(_sorted_state(dev), _sorted_state(cpu))


# Kernel-only hooks against NumPy.


def _filled_table(dim: int, m: int, opt: str = "sgd") -> tuple[Table, np.ndarray, np.ndarray]:
    """A GPU table of m imported rows (keys, values), column 0 holding key + 2.

    A table that only received inserts holds its rows at row ids 0..m-1.
    Values lie in [2, 3) (column 0: key + 2) so updates never cancel.
    """
    t = Table(dim, optimizer=OPTIMIZERS[opt][0](), name=_name("hook"), device="gpu")
    t.reserve(m)
    rng = np.random.default_rng(dim)
    keys = rng.permutation(m).astype(np.int64)
    values = (2 + rng.random((m, dim))).astype(np.float32)
    values[:, 0] = keys + 2
    t.import_rows(keys, values)
    return t, keys, values


def _gather_all(t: Table, m: int, dim: int) -> np.ndarray:
    out = cupy.empty((m, dim), cupy.float32)
    t.gather_rows(cupy.arange(m, dtype=cupy.uint32), out)
    t.synchronize()
    return cupy.asnumpy(out)


@needs_cupy
@pytest.mark.parametrize("dim", [1, 4, 31, 64, 128, 257])
def test_gather_rows_returns_the_exported_values(dim: int) -> None:
    m = 5000
    t, keys, values = _filled_table(dim, m)
    full = _gather_all(t, m, dim)
    # Row ids 0..m-1 hold each imported row once.
    row_keys = full[:, 0].astype(np.int64) - 2
    np.testing.assert_array_equal(np.sort(row_keys), np.arange(m))
    by_key = np.empty_like(values)
    by_key[keys] = values
    np.testing.assert_array_equal(full, by_key[row_keys])
    exported_keys, exported = t.export_rows()
    np.testing.assert_array_equal(full, exported[np.argsort(exported_keys)][row_keys])
    # Random row ids with repeats.
    rows = np.random.default_rng(1).integers(0, m, size=100_000).astype(np.uint32)
    out = cupy.full((rows.size, dim), np.nan, cupy.float32)
    t.gather_rows(cupy.asarray(rows), out)
    t.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(out), full[rows])


def _sequential_sums(rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows, float32 sums of their gradients added in input order)."""
    order = np.argsort(rows, kind="stable")
    r, g = rows[order], grads[order]
    uniq, start, counts = np.unique(r, return_index=True, return_counts=True)
    sums = g[start].copy()
    for j in range(1, int(counts.max())):
        more = counts > j
        sums[more] += g[start[more] + j]
    return uniq, sums


@needs_cupy
@pytest.mark.parametrize("dim", [1, 8, 33, 128])
def test_apply_rows_adagrad_matches_numpy_sum_then_apply(dim: int) -> None:
    m, n, lr = 5000, 50_000, 0.1
    t, _, _ = _filled_table(dim, m, opt="adagrad")
    opt = t.optimizer
    assert isinstance(opt, eo.Adagrad)
    before = _gather_all(t, m, dim)
    row_keys = before[:, 0].astype(np.int64) - 2
    rng = np.random.default_rng(dim)
    hot = rng.permutation(m)
    rows = hot[(rng.zipf(1.2, size=n) - 1) % m].astype(np.uint32)  # Zipf, many repeats
    grads = rng.standard_normal((n, dim)).astype(np.float32)
    t.apply_rows(cupy.asarray(rows), cupy.asarray(grads), lr, 1)
    t.synchronize()
    after = _gather_all(t, m, dim)

    uniq, sums = _sequential_sums(rows, grads)
    expected = before.copy()
    acc = np.full((m, dim), np.float32(opt.initial_accumulator_value), np.float32)
    value, slot = expected[uniq], acc[uniq]
    adagrad_update(
        value,
        slot[None],
        sums,
        lr,
        initial_accumulator_value=opt.initial_accumulator_value,
        epsilon=opt.epsilon,
    )
    expected[uniq], acc[uniq] = value, slot
    untouched = np.setdiff1d(np.arange(m), uniq)
    np.testing.assert_array_equal(after[untouched], before[untouched])
    np.testing.assert_allclose(after, expected, rtol=RTOL, atol=0)
    # The accumulator slot, through export_state (by key).
    state = _sorted_state(t)
    row_of_key = np.empty(m, np.int64)
    row_of_key[row_keys] = np.arange(m)
    np.testing.assert_array_equal(state.keys, np.arange(m))
    np.testing.assert_allclose(state.slots, acc[row_of_key], rtol=RTOL, atol=0)
    np.testing.assert_allclose(state.values, expected[row_of_key], rtol=RTOL, atol=0)
