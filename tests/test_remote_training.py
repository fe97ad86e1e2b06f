"""Training against real `elastic-emb serve` shards: the modes, multi-worker, resharding."""

import concurrent.futures
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import keras
import numpy as np
import pytest
import tensorflow as tf
from _cluster import serve_command, shards
from _processes import run_python
from _small_model import small_model, sorted_rows

import elastic_emb as ee
from elastic_emb import placement
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.persistence import checkpoint
from elastic_emb.ps.client.cluster import Cluster, ClusterOptions
from elastic_emb.ps.client.remote_table import RemoteTable
from elastic_emb.ps.coord.local_cluster import LocalCluster
from elastic_emb.ps.wire import protocol as wire

WORKER = Path(__file__).parent / "_remote_worker.py"


@pytest.fixture
def connected():
    """Calls ee.init(...) and always disconnects."""
    yield ee.init
    ee.shutdown()


def _tables(model: keras.Model) -> list[ee.Embedding]:
    return [layer for layer in model.layers if isinstance(layer, ee.Embedding)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_worker_equals_in_process_exactly(connected, mode):
    """One worker reads its own pushes in every mode: training is exactly in-process."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 300, (1024, 2))
    y = rng.integers(0, 2, (1024, 1)).astype(np.float32)
    local = small_model("exact")
    local_loss = local.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    with shards(2) as ps:
        cluster = connected(ps=[s.address for s in ps], mode=mode)
        model = small_model("exact")
        loss = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        assert loss.history["loss"] == local_loss.history["loss"]
        for remote_layer, local_layer in zip(_tables(model), _tables(local), strict=True):
            assert isinstance(remote_layer.table, RemoteTable)
            assert remote_layer.table.iterations == local_layer.table.iterations == 32
            keys, values = sorted_rows(remote_layer.table)
            local_keys, local_values = sorted_rows(local_layer.table)
            np.testing.assert_array_equal(keys, local_keys)
            np.testing.assert_array_equal(values, local_values)
        for weight, local_weight in zip(model.get_weights(), local.get_weights(), strict=True):
            np.testing.assert_array_equal(weight, local_weight)
        # Fused: one Pull and one Push per shard per step, for both tables.
        for stats in cluster.server_stats():
            calls = {m.method: m.calls for m in stats.methods}
            assert calls["Pull"] == calls["Push"] == 32


def test_an_export_from_shards_serves_as_one_from_in_process_tables(connected, tmp_path):
    """A SavedModel exported while the tables live on 2 shards holds every shard's rows:
    it predicts bit for bit as the in-process twin's export. So does the next version,
    applied from a delta exported from the shards."""
    import tensorflow as tf

    rng = np.random.default_rng(1)
    x = rng.integers(0, 300, (512, 2))
    y = rng.integers(0, 2, (512, 1)).astype(np.float32)
    more = rng.integers(200, 500, (256, 2))
    local = small_model("exported")
    local.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    ee.export_saved_model(local, tmp_path / "local" / "1")
    local.fit(more, y[:256], batch_size=64, epochs=1, shuffle=False, verbose=0)
    ee.export_saved_model(local, tmp_path / "local" / "2")
    with shards(2) as ps:
        connected(ps=[s.address for s in ps], mode="sync")
        model = small_model("exported")
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        ee.export_saved_model(model, tmp_path / "remote" / "1")
        model.fit(more, y[:256], batch_size=64, epochs=1, shuffle=False, verbose=0)
        ee.export_delta(model, tmp_path / "delta", since=tmp_path / "remote" / "1")
    ee.apply_delta(tmp_path / "remote" / "1", tmp_path / "delta")
    probe = tf.constant(np.concatenate([x[:100], more[:50], rng.integers(500, 600, (20, 2))]))
    for version in ("1", "2"):
        local_saved = tf.saved_model.load(str(tmp_path / "local" / version))
        remote_saved = tf.saved_model.load(str(tmp_path / "remote" / version))
        local_serving, remote_serving = local_saved.serve(probe), remote_saved.serve(probe)
        np.testing.assert_array_equal(remote_serving.numpy(), local_serving.numpy())
    np.testing.assert_array_equal(local_serving.numpy(), local.predict(probe, verbose=0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _export(address: str, table: str) -> tuple[np.ndarray, np.ndarray]:
    """A server's rows of `table`, over every slot range it holds."""
    keys, values = [], []
    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        for range_id in stub.Health(ps_pb2.HealthRequest(), timeout=60).ranges:
            reply = stub.ExportRows(
                ps_pb2.ExportRowsRequest(table=table, range=range_id), timeout=60
            )
            keys.append(wire.decode_keys(reply.keys))
            values.append(wire.decode_floats(reply.values, ps_pb2.FLOAT32, len(keys[-1]), 8))
    return np.concatenate(keys), np.concatenate(values)


@contextlib.contextmanager
def _static_shards() -> Iterator[tuple[Callable[[], list[str]], list[str]]]:
    """Two PS shards: (their addresses, the worker arguments that use them)."""
    with shards(2) as ps:
        addresses = [s.address for s in ps]
        yield lambda: addresses, ["--ps", ",".join(addresses)]


@contextlib.contextmanager
def _replicated_shards(directory: Path) -> Iterator[tuple[Callable[[], list[str]], list[str]]]:
    """Two groups of two replicas on etcd; worker 0 kills the primary of group 0 mid-fit."""
    with LocalCluster(2, 2, directory) as c:
        pid = c.servers[c.primaries()[0]].pid
        yield c.primaries, ["--coordinator", c.coordinator, "--kill", str(pid)]


def _multi_worker_run(data: Path, out: Path, mode: str, failover: bool = False) -> dict:
    """2 workers under MultiWorkerMirroredStrategy with 2 PS shards; results of worker 0.

    With `failover`, the shards are replica groups and a primary is killed mid-fit.
    """
    out.mkdir()
    servers = _replicated_shards(out / "cluster") if failover else _static_shards()
    with servers as (ps, worker_args):
        workers = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
        procs = []
        for i in range(2):
            tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
            command = [sys.executable, str(WORKER), str(data), str(out / f"worker{i}.npz")]
            command += ["--batch", "1024", "--epochs", "2", "--mode", mode]
            command += worker_args if i == 0 else worker_args[:2]
            command += ["--tf-config", json.dumps(tf_config)]
            procs.append(
                subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, stdout + stderr[-4000:]
        tables = {}
        for i in range(8):
            parts = [_export(address, f"C{i + 1}") for address in ps()]
            keys = np.concatenate([k for k, _ in parts])
            values = np.concatenate([v for _, v in parts])
            order = np.argsort(keys)
            tables[f"C{i + 1}"] = (keys[order], values[order])
    result = dict(np.load(out / "worker0.npz"))
    result["tables"] = tables
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference (1 worker, batch B, in-process) and 2-worker sync and async runs."""
    root = tmp_path_factory.mktemp("runs")
    data = root / "data"
    data.mkdir()
    ee.data.generate_criteo(data / "train.tsv", 65536, seed=0)
    ee.data.generate_criteo(data / "test.tsv", 16384, seed=0, sample_seed=1)
    (root / "reference").mkdir()
    run_python(WORKER, data, root / "reference" / "out.npz", "--batch", "1024", "--epochs", "2")
    reference = dict(np.load(root / "reference" / "out.npz"))
    _, states = checkpoint.read_shards([root / "reference" / "reference_tables"], None)
    reference["tables"] = {}
    for name, state in states.items():
        order = np.argsort(state.keys)
        reference["tables"][name] = (state.keys[order], state.values[order])
    return {
        "reference": reference,
        "sync": _multi_worker_run(data, root / "sync", "sync"),
        "async": _multi_worker_run(data, root / "async", "async"),
        "sync_failover": _multi_worker_run(data, root / "failover", "sync", failover=True),
    }


def test_two_workers_sync_equal_one_worker_with_twice_the_batch(runs):
    """MultiWorkerMirroredStrategy, 2 workers x batch B/2 + 2 PS == 1 worker x batch B."""
    reference, sync = runs["reference"], runs["sync"]
    np.testing.assert_allclose(sync["loss"], reference["loss"], rtol=1e-5)
    weights = sorted(k for k in reference if k.startswith("w"))
    assert weights
    for k in weights:
        np.testing.assert_allclose(sync[k], reference[k], rtol=1e-5, atol=1e-6)
    assert sorted(sync["tables"]) == sorted(reference["tables"])
    for name, (keys, values) in reference["tables"].items():
        np.testing.assert_array_equal(sync["tables"][name][0], keys)
        np.testing.assert_allclose(sync["tables"][name][1], values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sync["scores"], reference["scores"], rtol=1e-5, atol=1e-6)


def test_two_workers_lose_nothing_when_a_primary_is_killed_mid_fit(runs):
    """Replica groups: a kill -9 of a primary during model.fit changes no bit of the result."""
    sync, failover = runs["sync"], runs["sync_failover"]
    assert sorted(failover["tables"]) == sorted(sync["tables"])
    for name, (keys, values) in sync["tables"].items():
        np.testing.assert_array_equal(failover["tables"][name][0], keys)
        np.testing.assert_array_equal(failover["tables"][name][1], values)
    for k in [*sorted(k for k in sync if k.startswith("w")), "loss", "scores"]:
        np.testing.assert_array_equal(failover[k], sync[k])


def test_async_reaches_the_auc_of_sync(runs):
    sync_auc, async_auc = float(runs["sync"]["auc"]), float(runs["async"]["auc"])
    print(
        f"test AUC: reference {float(runs['reference']['auc']):.4f}, 2-worker sync "
        f"{sync_auc:.4f}, 2-worker async {async_auc:.4f}"
    )
    assert sync_auc > 0.65  # the models learned the planted signal
    assert abs(async_auc - sync_auc) < 0.01


def _sgd_table(cluster: Cluster, name: str) -> None:
    config = ee.Table(dim=2, optimizer=ee.optimizers.SGD(1.0), initializer="zeros", name=name)
    cluster.create_tables([config.config()])


def test_sync_sums_the_workers_pushes_and_waits_for_all_of_them():
    with shards(2) as ps:
        addresses = [s.address for s in ps]
        workers = [
            Cluster(addresses, ClusterOptions("sync", None, "float32", i, 2, 3.0, 30))
            for i in (0, 1)
        ]
        try:
            _sgd_table(workers[0], "sync_sum")
            keys = np.arange(6)
            g0 = np.arange(12, dtype=np.float32).reshape(6, 2)
            g1 = np.full((6, 2), 0.5, np.float32)
            workers[0].push({"sync_sum": (2, keys, g0)})
            # Worker 1 has not pushed step 1: worker 0 cannot pull step 2.
            with pytest.raises(TimeoutError, match=r"workers \[1\] have not pushed"):
                workers[0].pull([("sync_sum", 2, keys)], insert=False)
            workers[1].push({"sync_sum": (2, keys, g1)})
            (rows,) = workers[0].pull([("sync_sum", 2, keys)], insert=False)
            np.testing.assert_array_equal(rows, -(g0 + g1))  # one SGD step, lr 1, from zeros
        finally:
            for w in workers:
                w.close()


def test_bounded_staleness_holds_the_fast_worker_back():
    with shards(1) as ps:
        addresses = [ps[0].address]
        workers = [
            Cluster(addresses, ClusterOptions("async", 1, "float32", i, 2, 2.0, 30)) for i in (0, 1)
        ]
        try:
            _sgd_table(workers[0], "stale")
            keys = np.arange(3)
            ones = np.ones((3, 2), np.float32)
            workers[0].push({"stale": (2, keys, ones)})  # step 1, applied at once
            (rows,) = workers[0].pull([("stale", 2, keys)], insert=False)
            np.testing.assert_array_equal(rows, -ones)
            workers[0].push({"stale": (2, keys, ones)})  # step 2
            # Starting step 3 needs every worker at step 3 - 1 - 1 = 1.
            with pytest.raises(TimeoutError, match=r"staleness 1"):
                workers[0].pull([("stale", 2, keys)], insert=False)
            workers[1].push({"stale": (2, keys, ones)})
            (rows,) = workers[0].pull([("stale", 2, keys)], insert=False)
            np.testing.assert_array_equal(rows, -3 * ones)
        finally:
            for w in workers:
                w.close()


def _state(table: ee.Table) -> dict[str, np.ndarray]:
    state = table.export_state()
    order = np.argsort(state.keys)
    return {
        **{f: getattr(state, f)[order] for f in state.FIELDS},
        "iterations": np.array(state.iterations),
    }


def test_restore_onto_a_different_number_of_shards(connected, tmp_path):
    rng = np.random.default_rng(3)
    keys = rng.integers(-(2**62), 2**62, 5000)
    with shards(2) as ps:
        connected(ps=[s.address for s in ps], mode="async")
        table = ee.Table(dim=5, optimizer=ee.optimizers.Adam(0.01), name="reshard")
        for _ in range(3):
            batch = rng.choice(keys, 2000)
            table.pull(batch)
            table.push(batch, rng.normal(size=(2000, 5)).astype(np.float32))
        saved = _state(table)
        ee.save(tmp_path / "ckpt")
        ee.shutdown()
    assert saved["iterations"] == 3 and len(saved["keys"]) > 2000
    with shards(3) as ps:
        connected(ps=[s.address for s in ps], mode="async")
        restored = ee.restore(tmp_path / "ckpt")["reshard"]
        assert isinstance(restored, RemoteTable)
        for field, expected in saved.items():
            np.testing.assert_array_equal(_state(restored)[field], expected)
        # Every shard holds exactly the keys it owns now.
        counts = [int(r.tables[0].rows) for r in restored.cluster.per_shard(
            "DescribeTables", lambda i: ps_pb2.DescribeTablesRequest(names=["reshard"])
        )]  # fmt: skip
        owners = ee.sharding.shard_of(saved["keys"], 3)
        assert counts == [int((owners == i).sum()) for i in range(3)]
        ee.save(tmp_path / "ckpt3")
        ee.shutdown()
    # And back in-process.
    local = ee.Table(dim=5, optimizer=ee.optimizers.Adam(0.01), name="reshard_local")
    checkpoint_tables = ee.restore(tmp_path / "ckpt3")
    for field, expected in saved.items():
        np.testing.assert_array_equal(_state(checkpoint_tables["reshard"])[field], expected)
    del local


def _demo(*args: str) -> str:
    small = ["--examples", "20000", "--test-examples", "5000", "--epochs", "1", "--verbose", "0"]
    proc = subprocess.run(
        [*serve_command(), "demo", *small, *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def test_demo_trains_against_a_cluster_as_in_process():
    with shards(2) as ps:
        addresses = [s.address for s in ps]
        remote_out = _demo("--ps", ",".join(addresses), "--mode", "sync")
    assert "tables on 2 PS shard(s) (sync, float32 wire)" in remote_out
    for address in addresses:
        assert address in remote_out  # the per-shard traffic table
    # One sync worker trains exactly as in-process: the same test AUC.
    local_out = _demo()
    auc = [out.split("test AUC")[1].split()[0] for out in (remote_out, local_out)]
    assert auc[0] == auc[1]


def test_checkpoint_callback_refuses_several_workers(connected, tmp_path):
    with shards(1) as ps:
        connected(ps=[ps[0].address], mode="async", worker_index=0, num_workers=2)
        model = small_model("several")
        x = np.zeros((8, 2), np.int64)
        y = np.zeros((8, 1), np.float32)
        with pytest.raises(ValueError, match="supports one worker; with 2 workers"):
            model.fit(x, y, epochs=1, verbose=0, callbacks=[ee.callbacks.Checkpoint(tmp_path)])


def test_environment_variable_makes_tables_remote(tmp_path):
    script = tmp_path / "env_worker.py"
    script.write_text(
        "import numpy as np\n"
        "import elastic_emb as ee\n"
        "t = ee.Table(dim=3, optimizer=ee.optimizers.SGD(1.0), initializer='zeros', name='env')\n"
        "t.push(np.array([5]), np.ones((1, 3), np.float32))\n"
        "print(type(t).__name__, t.pull(np.array([5]))[0].tolist())\n"
    )
    with shards(1) as ps:
        env = {"ELASTIC_EMB_PS": ps[0].address}
        out = run_python(script, env=env)
        # A second process sees the first one's update on the shard.
        out2 = run_python(script, env=env)
    assert out.strip() == "RemoteTable [-1.0, -1.0, -1.0]"
    assert out2.strip() == "RemoteTable [-2.0, -2.0, -2.0]"


@pytest.mark.parametrize(
    "tf_config, expected",
    [
        ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}, (1, 2)),
        (
            {
                "cluster": {"chief": ["c:1"], "worker": ["a:1", "b:1"]},
                "task": {"type": "worker", "index": 0},
            },
            (1, 3),
        ),
        (
            {
                "cluster": {"chief": ["c:1"], "worker": ["a:1"]},
                "task": {"type": "chief", "index": 0},
            },
            (0, 2),
        ),
    ],
)
def test_worker_index_and_count_come_from_tf_config(monkeypatch, tf_config, expected):
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    assert placement._tf_config_worker() == expected
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match="TF_CONFIG"):
        placement._tf_config_worker()


def test_remote_table_behaves_as_the_local_table(connected):
    """Every Table method, remote over 3 shards vs in-process, on the same calls."""
    rng = np.random.default_rng(11)
    keys = rng.integers(-(2**40), 2**40, 300)
    local = ee.Table(dim=3, optimizer=ee.optimizers.Adagrad(0.1), name="same_local", seed=4)
    with shards(3) as ps:
        connected(ps=[s.address for s in ps], mode="async")
        table = ee.Table(dim=3, optimizer=ee.optimizers.Adagrad(0.1), name="same_remote", seed=4)
        assert isinstance(table, RemoteTable)
        for t in (local, table):
            t.import_rows(keys[:100], np.arange(300, dtype=np.float32).reshape(100, 3))
            t.pull(keys[50:200])
            t.push(keys[::3], np.ones((100, 3), np.float32))
            t.push(keys[::5], np.full((60, 3), 0.5, np.float32))
        for got, expected in zip(
            (table.pull(keys, train=False), table.metadata(keys), table.erase(keys[:7])),
            (local.pull(keys, train=False), local.metadata(keys), local.erase(keys[:7])),
            strict=True,
        ):
            np.testing.assert_array_equal(got, expected)
        assert len(table) == len(local) and table.iterations == local.iterations == 2
        assert sorted_rows(table)[0].tolist() == sorted_rows(local)[0].tolist()
        np.testing.assert_array_equal(sorted_rows(table)[1], sorted_rows(local)[1])
        assert table.memory_bytes() > 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lookahead_reads_rows_a_step_ahead_and_trains_exactly(connected, mode):
    """ee.lookahead: steps use rows read while the step before ended; tables, weights and
    losses are those of in-process training, and the batch after the last step, read ahead
    but never trained, added no rows."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 3000, (4096, 2))  # many ids first seen late: inserted by pushes
    y = rng.integers(0, 2, (4096, 1)).astype(np.float32)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(64).repeat()
    local = small_model("ahead")
    local_loss = local.fit(batches, steps_per_epoch=16, epochs=2, verbose=0)
    with shards(2) as ps:
        cluster = connected(ps=[s.address for s in ps], mode=mode)
        model = small_model("ahead")
        ahead = ee.lookahead(batches, model)
        loss = model.fit(ahead, steps_per_epoch=16, epochs=2, verbose=0)
        # At most every step but the first; fewer when the input pipeline announced a batch
        # only after the step before it was pushed (then the step pulls as usual).
        assert 8 <= cluster.steps_read_ahead <= 31
        assert loss.history["loss"] == local_loss.history["loss"]
        for remote_layer, local_layer in zip(_tables(model), _tables(local), strict=True):
            assert remote_layer.table.iterations == local_layer.table.iterations == 32
            keys, values = sorted_rows(remote_layer.table)
            local_keys, local_values = sorted_rows(local_layer.table)
            np.testing.assert_array_equal(keys, local_keys)
            np.testing.assert_array_equal(values, local_values)
            meta = remote_layer.table.metadata(keys)
            np.testing.assert_array_equal(meta, local_layer.table.metadata(keys))
        for weight, local_weight in zip(model.get_weights(), local.get_weights(), strict=True):
            np.testing.assert_array_equal(weight, local_weight)
        # The 33rd batch was read ahead (sent after the last push); its new ids got no row.
        unseen = np.setdiff1d(x[32 * 64 : 33 * 64, 0], x[: 32 * 64, 0])
        assert len(unseen) and not np.isin(unseen, sorted_rows(_tables(model)[0].table)[0]).any()


def test_a_push_never_waits_behind_pulls_the_shards_hold():
    """Pulls of step 2 (rows read ahead are such pulls) are held by the shard until this
    worker's push of step 1 arrives: they must not keep the client from sending it."""
    with shards(1) as ps:
        worker = Cluster([ps[0].address], ClusterOptions("sync", None, "float32", 0, 1, 20.0, 30))
        held = concurrent.futures.ThreadPoolExecutor(4)
        try:
            _sgd_table(worker, "held")
            keys = np.arange(4)
            # As many as the client has threads for pulls (4): each is held by the shard.
            pulls = [held.submit(worker._pull, [("held", 2, keys)], False, 2) for _ in range(4)]
            time.sleep(0.5)
            worker.push({"held": (2, keys, np.ones((4, 2), np.float32))})  # step 1
            for pull in pulls:  # one SGD step, lr 1, from zeros
                np.testing.assert_array_equal(pull.result(timeout=15)[0], -np.ones((4, 2)))
        finally:
            held.shutdown(wait=False, cancel_futures=True)
            worker.close()
