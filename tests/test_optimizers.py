"""Tests of the table's sparse optimizers against NumPy references of the Keras formulas.

The references (tests/_numpy_reference.py) are written from
keras/src/optimizers/{sgd,adagrad,adam,ftrl,rmsprop}.py; a side-by-side stock Keras
optimizer on a dense variable checks the references themselves where dense and
lazy updates agree (every row touched by every push).
"""

from __future__ import annotations

import itertools
import json
import math

import keras
import numpy as np
import pytest
from _numpy_reference import F32, ReferenceTable

import elastic_emb as ee
from elastic_emb.tables.policies import optimizers as eo

_names = itertools.count()


def _name(prefix: str) -> str:
    return f"{prefix}_opt_{next(_names)}"


# (table optimizer, reference kind, reference hyperparameters, keras optimizer factory)
CASES = {
    "sgd": (
        eo.SGD(learning_rate=0.1),
        "sgd",
        {},
        lambda: keras.optimizers.SGD(learning_rate=0.1),
    ),
    "sgd_momentum": (
        eo.SGD(learning_rate=0.05, momentum=0.9),
        "sgd",
        {"momentum": 0.9},
        lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
    ),
    "sgd_nesterov": (
        eo.SGD(learning_rate=0.05, momentum=0.8, nesterov=True),
        "sgd",
        {"momentum": 0.8, "nesterov": True},
        lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.8, nesterov=True),
    ),
    "adagrad": (
        eo.Adagrad(learning_rate=0.1, initial_accumulator_value=0.2, epsilon=1e-6),
        "adagrad",
        {"initial_accumulator_value": 0.2, "epsilon": 1e-6},
        lambda: keras.optimizers.Adagrad(
            learning_rate=0.1, initial_accumulator_value=0.2, epsilon=1e-6
        ),
    ),
    "adam": (
        eo.Adam(learning_rate=0.01, beta_1=0.85, beta_2=0.99, epsilon=1e-6),
        "adam",
        {"beta_1": 0.85, "beta_2": 0.99, "epsilon": 1e-6},
        lambda: keras.optimizers.Adam(learning_rate=0.01, beta_1=0.85, beta_2=0.99, epsilon=1e-6),
    ),
    "adam_defaults": (
        eo.Adam(learning_rate=0.02),
        "adam",
        {},
        lambda: keras.optimizers.Adam(learning_rate=0.02),
    ),
    "ftrl": (
        eo.Ftrl(
            learning_rate=0.1,
            learning_rate_power=-0.6,
            initial_accumulator_value=0.2,
            l1_regularization_strength=0.01,
            l2_regularization_strength=0.02,
            l2_shrinkage_regularization_strength=0.03,
            beta=0.5,
        ),
        "ftrl",
        {
            "learning_rate_power": -0.6,
            "initial_accumulator_value": 0.2,
            "l1_regularization_strength": 0.01,
            "l2_regularization_strength": 0.02,
            "l2_shrinkage_regularization_strength": 0.03,
            "beta": 0.5,
        },
        lambda: keras.optimizers.Ftrl(
            learning_rate=0.1,
            learning_rate_power=-0.6,
            initial_accumulator_value=0.2,
            l1_regularization_strength=0.01,
            l2_regularization_strength=0.02,
            l2_shrinkage_regularization_strength=0.03,
            beta=0.5,
        ),
    ),
    "ftrl_defaults": (
        eo.Ftrl(learning_rate=0.2),
        "ftrl",
        {},
        lambda: keras.optimizers.Ftrl(learning_rate=0.2),
    ),
    "rmsprop": (
        eo.RMSprop(learning_rate=0.01),
        "rmsprop",
        {},
        lambda: keras.optimizers.RMSprop(learning_rate=0.01),
    ),
    "rmsprop_momentum_centered": (
        eo.RMSprop(learning_rate=0.01, rho=0.8, momentum=0.5, epsilon=1e-6, centered=True),
        "rmsprop",
        {"rho": 0.8, "momentum": 0.5, "epsilon": 1e-6, "centered": True},
        lambda: keras.optimizers.RMSprop(
            learning_rate=0.01, rho=0.8, momentum=0.5, epsilon=1e-6, centered=True
        ),
    ),
    "rmsprop_centered": (
        eo.RMSprop(learning_rate=0.02, centered=True),
        "rmsprop",
        {"centered": True},
        lambda: keras.optimizers.RMSprop(learning_rate=0.02, centered=True),
    ),
}


def _twin_init(dim: int, seed: int):
    """Initial values read from a separate table with the same seed (train=False)."""
    twin = ee.Table(
        dim=dim, optimizer=eo.SGD(0.1), initializer="uniform", name=_name("twin"), seed=seed
    )

    def init(key: int) -> np.ndarray:
        return twin.pull(np.array([key], np.int64), train=False)[0]

    init.table = twin  # keep alive
    return init


def _state_by_key(table: ee.Table) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    st = table.export_state()
    return {int(k): (st.values[i], st.slots[i]) for i, k in enumerate(st.keys)}


def _assert_matches(table: ee.Table, ref: ReferenceTable, rtol: float, atol: float) -> None:
    got = _state_by_key(table)
    assert sorted(got) == sorted(ref.values), "table holds different keys than the reference"
    keys = np.array(sorted(got), np.int64)
    want_values, want_slots = ref.rows(keys)
    got_values = np.stack([got[int(k)][0] for k in keys])
    got_slots = np.stack([got[int(k)][1] for k in keys])
    np.testing.assert_allclose(got_values, want_values, rtol=rtol, atol=atol)
    np.testing.assert_allclose(got_slots, want_slots, rtol=rtol, atol=atol)
    assert table.iterations == ref.iterations


@pytest.mark.parametrize("dim", [1, 3, 16, 33])
@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_matches_numpy_reference(case: str, dim: int) -> None:
    opt, kind, hparams, _ = CASES[case]
    seed = 1234 + dim
    table = ee.Table(dim=dim, optimizer=opt, initializer="uniform", name=_name(case), seed=seed)
    ref = ReferenceTable(kind, dim, _twin_init(dim, seed), **hparams)
    rng = np.random.default_rng(dim)
    pool = np.array(
        [0, 1, 2, 3, 5, 8, 13, -1, -7, 2**40, -(2**62), 2**63 - 1, *range(100, 120)], np.int64
    )
    only_first = np.array([777_001, 777_002], np.int64)  # touched by push 1 only
    snapshot = None
    for push in range(7):
        keys = rng.choice(pool, size=24, replace=True)  # duplicates inside a push
        if push == 0:
            keys = np.concatenate([keys, only_first, only_first[:1]])
        if push % 2 == 0:  # the layer pulls before it pushes; pushing unseen keys inserts them
            np.testing.assert_allclose(
                table.pull(keys, train=True), ref.pull(keys), rtol=2e-6, atol=1e-7
            )
        grads = rng.normal(0.0, 1.0, size=(keys.size, dim)).astype(np.float32)
        lr = opt.learning_rate
        table.push(keys, grads)
        ref.push(keys, grads, lr)
        _assert_matches(table, ref, rtol=2e-6, atol=1e-7)
        if push == 0:
            snapshot = {k: _state_by_key(table)[int(k)] for k in only_first}
    # Lazy semantics: rows untouched since push 1 kept their value and slots exactly.
    final = _state_by_key(table)
    for k, (value, slots) in snapshot.items():
        np.testing.assert_array_equal(final[int(k)][0], value)
        np.testing.assert_array_equal(final[int(k)][1], slots)
    last_step, count = table.metadata(only_first)
    np.testing.assert_array_equal(last_step, [1, 1])
    np.testing.assert_array_equal(count, [1, 1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_and_table_match_stock_keras_when_every_row_is_pushed(case: str) -> None:
    """Dense Keras == lazy table when every push touches every row exactly once."""
    opt, kind, hparams, make_keras = CASES[case]
    n, dim, steps = 6, 3, 5
    keys = np.arange(10, 10 + n, dtype=np.int64)
    table = ee.Table(dim=dim, optimizer=opt, initializer="uniform", name=_name(case), seed=9)
    init = table.pull(keys, train=False)
    ref = ReferenceTable(kind, dim, lambda k: init[k - 10], **hparams)
    var = keras.Variable(init.copy(), dtype="float32")
    kopt = make_keras()
    rng = np.random.default_rng(3)
    for _ in range(steps):
        grads = rng.normal(0.0, 1.0, size=(n, dim)).astype(np.float32)
        table.push(keys, grads)
        ref.push(keys, grads, opt.learning_rate)
        kopt.apply_gradients([(keras.ops.convert_to_tensor(grads), var)])
    keras_values = keras.ops.convert_to_numpy(var)
    ref_values, _ = ref.rows(keys)
    np.testing.assert_allclose(ref_values, keras_values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(table.pull(keys, train=False), keras_values, rtol=1e-5, atol=1e-6)
    assert int(kopt.iterations.numpy()) == table.iterations == steps


def test_duplicates_are_summed_before_one_update() -> None:
    """Adam is not additive, so one update of the sum differs from two updates."""
    opt = eo.Adam(learning_rate=0.1)
    summed = ee.Table(dim=2, optimizer=opt, initializer="zeros", name=_name("dup"))
    dup = ee.Table(dim=2, optimizer=opt, initializer="zeros", name=_name("dup"))
    g = np.array([[1.0, -2.0], [3.0, 0.5]], np.float32)
    summed.push(np.array([4]), g.sum(axis=0, keepdims=True))
    dup.push(np.array([4, 4]), g)
    np.testing.assert_array_equal(summed.export_state().values, dup.export_state().values)
    np.testing.assert_array_equal(summed.export_state().slots, dup.export_state().slots)
    np.testing.assert_array_equal(dup.metadata(np.array([4]))[1], [1])  # one update


def test_adam_bias_correction_uses_global_push_count() -> None:
    """A key first pushed at step 3 is corrected with t=3, not t=1."""
    table = ee.Table(
        dim=1, optimizer=eo.Adam(learning_rate=0.1), initializer="zeros", name=_name("adam_t")
    )
    for _ in range(2):
        table.push(np.array([1]), np.ones((1, 1), np.float32))
    table.push(np.array([2]), np.ones((1, 1), np.float32))
    # t=3, m=0.1, v=0.001: alpha = 0.1*sqrt(1-0.999^3)/(1-0.9^3)
    b1p, b2p = F32(0.9) ** F32(3), F32(0.999) ** F32(3)
    alpha = F32(0.1) * np.sqrt(F32(1) - b2p) / (F32(1) - b1p)
    m, v = F32(1 - 0.9), F32(1 - 0.999)
    expected = -(m * alpha) / (np.sqrt(v) + F32(1e-7))
    # (Loose tolerance: this test is about t; float precision is tested above.)
    got = table.pull(np.array([2]), train=False)[0, 0]
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    # With t=1 the step would be -lr (= -0.1); with t=3 it is markedly different.
    assert abs(expected + 0.1) > 0.01
    assert abs(got + 0.1) > 0.01


# Learning-rate schedules.


def test_exponential_decay_step_k_uses_schedule_of_k_minus_1() -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    table = ee.Table(
        dim=2, optimizer=eo.SGD(learning_rate=schedule), initializer="zeros", name=_name("expdecay")
    )
    for k in range(1, 6):
        # key k only in push k: its value is exactly -lr_k.
        table.push(np.array([k]), np.ones((1, 2), np.float32))
    values = table.pull(np.arange(1, 6), train=False)
    expected = np.array([F32(0.1) * F32(0.5) ** (k - 1) for k in range(1, 6)], np.float32)
    np.testing.assert_array_equal(values, -np.stack([expected, expected], axis=1))
    for k in range(1, 6):
        assert F32(keras.ops.convert_to_numpy(schedule(k - 1))) == expected[k - 1]


def test_piecewise_constant_decay_with_adagrad_matches_reference() -> None:
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1, 2], [0.1, 0.01, 0.001])
    lrs = [0.1, 0.1, 0.01, 0.001, 0.001]  # schedule(0), schedule(1), ... by hand
    table = ee.Table(
        dim=3,
        optimizer=eo.Adagrad(learning_rate=schedule),
        initializer="zeros",
        name=_name("piecewise"),
    )
    ref = ReferenceTable("adagrad", 3, lambda k: np.zeros(3, np.float32))
    rng = np.random.default_rng(0)
    for lr in lrs:
        keys = rng.choice(np.arange(6), size=5)
        grads = rng.normal(size=(5, 3)).astype(np.float32)
        table.push(keys, grads)
        ref.push(keys, grads, lr)
    _assert_matches(table, ref, rtol=2e-6, atol=1e-7)
    # A constant learning rate of 0.1 gives different rows: the schedule is used.
    const = ReferenceTable("adagrad", 3, lambda k: np.zeros(3, np.float32))
    rng = np.random.default_rng(0)
    for _ in lrs:
        keys = rng.choice(np.arange(6), size=5)
        const.push(keys, rng.normal(size=(5, 3)).astype(np.float32), 0.1)
    keys = np.array(sorted(const.values))
    assert not np.allclose(table.pull(keys, train=False), const.rows(keys)[0], rtol=1e-3)


# Conversion from keras.optimizers.


@pytest.mark.parametrize(
    ("keras_opt", "cls", "expected"),
    [
        (
            lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True),
            eo.SGD,
            {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True},
        ),
        (
            lambda: keras.optimizers.SGD(),
            eo.SGD,
            {"learning_rate": 0.01, "momentum": 0.0, "nesterov": False},
        ),
        (
            lambda: keras.optimizers.Adagrad(
                learning_rate=0.2, initial_accumulator_value=0.3, epsilon=1e-5
            ),
            eo.Adagrad,
            {"learning_rate": 0.2, "initial_accumulator_value": 0.3, "epsilon": 1e-5},
        ),
        (
            lambda: keras.optimizers.Adam(
                learning_rate=0.003, beta_1=0.8, beta_2=0.95, epsilon=1e-6
            ),
            eo.Adam,
            {"learning_rate": 0.003, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6},
        ),
        (
            lambda: keras.optimizers.Ftrl(
                learning_rate=0.4,
                learning_rate_power=-0.7,
                initial_accumulator_value=0.25,
                l1_regularization_strength=0.01,
                l2_regularization_strength=0.02,
                l2_shrinkage_regularization_strength=0.03,
                beta=0.4,
            ),
            eo.Ftrl,
            {
                "learning_rate": 0.4,
                "learning_rate_power": -0.7,
                "initial_accumulator_value": 0.25,
                "l1_regularization_strength": 0.01,
                "l2_regularization_strength": 0.02,
                "l2_shrinkage_regularization_strength": 0.03,
                "beta": 0.4,
            },
        ),
    ],
)
def test_keras_optimizer_conversion_preserves_arguments(keras_opt, cls, expected) -> None:
    for converted in (
        eo.from_keras(keras_opt()),
        eo.get(keras_opt()),
        ee.Table(dim=2, optimizer=keras_opt(), name=_name("conv")).optimizer,
    ):
        assert type(converted) is cls
        for arg, value in expected.items():
            got = getattr(converted, arg)
            if arg == "learning_rate":  # Keras holds it in a float32 variable
                assert F32(got) == F32(value), (arg, got, value)
            else:
                assert got == value, (arg, got, value)


def test_keras_optimizer_with_schedule_keeps_the_schedule() -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    converted = eo.from_keras(keras.optimizers.Adam(learning_rate=schedule))
    assert converted.learning_rate is schedule
    assert converted.learning_rate_at(20) == pytest.approx(0.1 * 0.9**2, rel=1e-6)


@pytest.mark.parametrize(
    ("option", "kwargs"),
    [
        ("clipnorm", {"clipnorm": 1.0}),
        ("clipvalue", {"clipvalue": 0.5}),
        ("global_clipnorm", {"global_clipnorm": 2.0}),
        ("weight_decay", {"weight_decay": 0.01}),
        ("use_ema", {"use_ema": True}),
        ("gradient_accumulation_steps", {"gradient_accumulation_steps": 2}),
        ("loss_scale_factor", {"loss_scale_factor": 128.0}),
    ],
)
@pytest.mark.parametrize("cls", ["SGD", "Adagrad", "Adam", "Ftrl"])
def test_unsupported_keras_options_raise(cls: str, option: str, kwargs: dict) -> None:
    keras_opt = getattr(keras.optimizers, cls)(learning_rate=0.1, **kwargs)
    with pytest.raises(ValueError, match=f"`{option}`") as info:
        eo.from_keras(keras_opt)
    assert str(next(iter(kwargs.values()))) in str(info.value)
    with pytest.raises(ValueError, match=f"`{option}`"):
        ee.Table(dim=2, optimizer=keras_opt, name=_name("unsupported"))


def test_amsgrad_is_rejected() -> None:
    with pytest.raises(ValueError, match="`amsgrad`"):
        eo.from_keras(keras.optimizers.Adam(amsgrad=True))
    # Off is fine.
    assert eo.from_keras(keras.optimizers.Adam(amsgrad=False)) == eo.Adam(
        learning_rate=float(F32(0.001))
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.Adadelta(),
        lambda: keras.optimizers.Adamax(),
        lambda: keras.optimizers.Nadam(),
        lambda: keras.optimizers.AdamW(),
        lambda: keras.optimizers.Lion(),
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
    ],
)
def test_unsupported_keras_classes_raise_naming_the_class(make) -> None:
    keras_opt = make()
    name = type(keras_opt).__name__
    with pytest.raises(ValueError, match=name):
        eo.from_keras(keras_opt)
    with pytest.raises(ValueError, match=name):
        eo.get(keras_opt)


def test_unknown_optimizer_names_and_objects_raise() -> None:
    for bad in ("adadelta", "", 3, None, object()):
        with pytest.raises(ValueError, match="`optimizer`"):
            eo.get(bad)


@pytest.mark.parametrize(
    ("make", "arg", "value"),
    [
        (lambda: eo.SGD(learning_rate=-0.1), "learning_rate", -0.1),
        (lambda: eo.SGD(learning_rate=0.0), "learning_rate", 0.0),
        (lambda: eo.Adam(learning_rate=float("nan")), "learning_rate", float("nan")),
        (lambda: eo.Adagrad(learning_rate="0.1"), "learning_rate", "0.1"),
        (lambda: eo.SGD(learning_rate=True), "learning_rate", True),
        (lambda: eo.SGD(momentum=1.5), "momentum", 1.5),
        (lambda: eo.SGD(momentum=-0.1), "momentum", -0.1),
        (lambda: eo.SGD(momentum=float("nan")), "momentum", float("nan")),
        (lambda: eo.SGD(momentum="0.9"), "momentum", "0.9"),
        (lambda: eo.Adam(beta_1=1.0), "beta_1", 1.0),
        (lambda: eo.Adam(beta_1=-0.5), "beta_1", -0.5),
        (lambda: eo.Adam(beta_2=1.0), "beta_2", 1.0),
        (lambda: eo.Adam(epsilon=-1e-7), "epsilon", -1e-7),
        (lambda: eo.Adagrad(initial_accumulator_value=-0.1), "initial_accumulator_value", -0.1),
        (lambda: eo.Adagrad(epsilon=-1.0), "epsilon", -1.0),
        (lambda: eo.Ftrl(learning_rate_power=0.5), "learning_rate_power", 0.5),
        (lambda: eo.Ftrl(initial_accumulator_value=-1.0), "initial_accumulator_value", -1.0),
        (lambda: eo.Ftrl(l1_regularization_strength=-0.1), "l1_regularization_strength", -0.1),
        (lambda: eo.Ftrl(l2_regularization_strength=-0.1), "l2_regularization_strength", -0.1),
        (
            lambda: eo.Ftrl(l2_shrinkage_regularization_strength=-0.1),
            "l2_shrinkage_regularization_strength",
            -0.1,
        ),
        (lambda: eo.Ftrl(beta=-0.5), "beta", -0.5),
    ],
)
def test_bad_values_raise_naming_argument_and_value(make, arg: str, value) -> None:
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert f"`{arg}`" in message
    assert f"{arg}={value!r}" in message


def test_boundary_values_are_accepted() -> None:
    assert eo.SGD(momentum=1.0).momentum == 1.0
    assert eo.SGD(momentum=0).momentum == 0
    assert eo.Adam(beta_1=0.0, beta_2=0.0, epsilon=0.0).beta_1 == 0.0
    assert eo.Ftrl(learning_rate_power=0.0).learning_rate_power == 0.0
    assert eo.Adagrad(learning_rate=3).learning_rate == 3.0


def test_defaults_are_the_keras_defaults() -> None:
    pairs = [
        (eo.SGD(), keras.optimizers.SGD()),
        (eo.Adagrad(), keras.optimizers.Adagrad()),
        (eo.Adam(), keras.optimizers.Adam()),
        (eo.Ftrl(), keras.optimizers.Ftrl()),
    ]
    for ours, theirs in pairs:
        config = theirs.get_config()
        for arg, value in ours.get_config().items():
            if arg == "class_name":
                assert value == type(theirs).__name__
            elif arg == "learning_rate":
                assert F32(value) == F32(config[arg])
            else:
                assert value == config[arg], (type(ours).__name__, arg)


@pytest.mark.parametrize(
    "opt",
    [
        eo.SGD(learning_rate=0.3, momentum=0.5, nesterov=True),
        eo.Adagrad(learning_rate=0.2, initial_accumulator_value=0.4, epsilon=1e-3),
        eo.Adam(learning_rate=0.01, beta_1=0.7, beta_2=0.9, epsilon=1e-4),
        eo.Ftrl(
            learning_rate=0.5,
            learning_rate_power=-0.3,
            initial_accumulator_value=0.2,
            l1_regularization_strength=0.1,
            l2_regularization_strength=0.2,
            l2_shrinkage_regularization_strength=0.3,
            beta=0.4,
        ),
    ],
    ids=lambda o: type(o).__name__,
)
def test_get_config_from_config_round_trip(opt) -> None:
    config = opt.get_config()
    json.loads(json.dumps(config))  # checkpoints store it as JSON
    again = eo.Optimizer.from_config(json.loads(json.dumps(config)))
    assert again == opt
    assert type(again) is type(opt)
    assert eo.get(config) == opt
    assert again.get_config() == config


def test_get_config_round_trip_with_schedule() -> None:
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([3, 7], [0.5, 0.25, 0.125])
    opt = eo.Adagrad(learning_rate=schedule, epsilon=1e-3)
    config = json.loads(json.dumps(opt.get_config()))
    again = eo.Optimizer.from_config(config)
    assert isinstance(again.learning_rate, keras.optimizers.schedules.PiecewiseConstantDecay)
    assert again.get_config() == opt.get_config()
    for step in (0, 3, 4, 7, 8, 100):
        assert again.learning_rate_at(step) == opt.learning_rate_at(step)
    assert [opt.learning_rate_at(s) for s in (0, 4, 8)] == [0.5, 0.25, 0.125]
    assert math.isclose(again.epsilon, 1e-3)
