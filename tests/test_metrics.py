"""Prometheus metrics of a real `elastic-emb serve` (`--metrics-port`), scraped over HTTP.

The independent account is the client's: what it sent (calls, keys, pushes)
and its own byte counts of every message.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import numpy as np
import pytest
from _cluster import metrics_url, scrape, serve_once, shards

import elastic_emb as ee

DOCS = Path(__file__).parent.parent / "docs"


def test_a_server_exports_what_it_did():
    with shards(1, ["--metrics-port", "0"]) as (ps,):
        url = metrics_url(ps)
        cluster = ee.init(ps=[ps.address], mode="async")
        try:
            t = ee.Table(4, ee.optimizers.SGD(0.1), name="scraped", seed=0)
            keys = np.arange(100)
            for _ in range(3):
                t.pull(keys)
                t.push(keys, np.ones((100, 4), np.float32))
            cluster.flush()
            sent = sum(s["bytes_sent"] for s in cluster.stats())
            received = sum(s["bytes_received"] for s in cluster.stats())
            before_error = scrape(url)
            with pytest.raises(ValueError, match="Unknown table"):
                cluster.pull([("no_such_table", 4, np.arange(3))], True)
            m = scrape(url)
        finally:
            ee.shutdown()

    def value(name: str, **labels: str) -> float:
        return m[(f"elastic_emb_{name}", tuple(sorted(labels.items())))]

    assert value("rpc_calls_total", method="Pull") == 4  # 3 pulls and the bad one
    assert value("rpc_calls_total", method="Push") == 3
    assert value("rpc_errors_total", method="Pull", code="NOT_FOUND") == 1
    assert ("elastic_emb_rpc_errors_total", (("code", "NOT_FOUND"), ("method", "Push"))) not in m
    assert value("rpc_seconds_count", method="Pull") == 4
    assert value("rpc_seconds_bucket", method="Pull", le="+Inf") == 4
    buckets = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in m.items()
        if name == "elastic_emb_rpc_seconds_bucket" and dict(labels)["method"] == "Push"
    )
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative

    # Every message the client sent and received, byte for byte.
    def total(name: str) -> float:
        return sum(v for (n, _), v in before_error.items() if n == f"elastic_emb_{name}")

    server_received, server_sent = total("rpc_received_bytes_total"), total("rpc_sent_bytes_total")
    assert (server_received, server_sent) == (sent, received)
    assert value("table_rows", table="scraped") == 100
    assert value("table_pushes_total", table="scraped") == 3
    assert value("table_memory_bytes", table="scraped") > 100 * 4 * 4
    assert value("worker_step", range="0", worker="0") == 3
    assert value("worker_lag_steps", range="0", worker="0") == 0
    assert value("range_step", range="0") == 3

    # The Grafana dashboard asks for metrics the server has (replica_sequence:
    # only servers of a replicated cluster have it).
    dashboard = json.loads((DOCS / "kubernetes" / "grafana-dashboard.json").read_text())
    asked = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"elastic_emb_[a-z_]+", target["expr"])
    }
    scraped = {name for name, _ in m}
    assert asked - scraped == {"elastic_emb_replica_sequence"}


def test_a_metrics_port_in_use_is_refused_clearly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve_once("--metrics-port", str(port))
    assert done.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in done.stderr + done.stdout


def _model(prefix: str):
    import keras

    ids = keras.Input(shape=(2,), dtype="int64")
    emb = ee.Embedding(4, ee.optimizers.SGD(0.1), name=f"{prefix}_emb")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
    model.compile(optimizer="sgd", loss="mse")
    return model, emb


def _scalars(log_dir) -> dict[str, list[float]]:
    """The scalar summaries of a TensorBoard log directory, by tag, in step order."""
    import tensorflow as tf
    from tensorflow.core.util import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = event_pb2.Event.FromString(record.numpy())
            for v in event.summary.value:
                assert v.metadata.plugin_data.plugin_name == "scalars"
                out.setdefault(v.tag, []).append((event.step, tf.make_ndarray(v.tensor).item()))
    return {tag: [value for _, value in sorted(points)] for tag, points in out.items()}


def test_the_metrics_callback_logs_rows_to_keras_and_tensorboard(tmp_path):
    model, emb = _model("cb_local")
    x = np.random.default_rng(0).integers(0, 500, size=(640, 2))
    history = model.fit(
        x, np.ones((640, 1)), batch_size=64, epochs=2, verbose=0,
        callbacks=[ee.callbacks.Metrics(log_dir=tmp_path, every=5)],
    )  # fmt: skip
    assert history.history["ee_rows"] == [float(len(emb.table))] * 2  # all ids seen in epoch 1
    assert history.history["ee_bytes_per_step"] == [0.0, 0.0]  # in-process: no wire
    scalars = _scalars(tmp_path / "ee")
    assert len(scalars["ee_rows"]) == 20 // 5
    assert scalars["ee_rows"][-1] == len(emb.table)


def test_the_metrics_callback_measures_the_wire_of_remote_tables():
    with shards(1) as (ps,):
        cluster = ee.init(ps=[ps.address], mode="async")
        try:
            model, emb = _model("cb_remote")
            x = np.random.default_rng(1).integers(0, 500, size=(640, 2))
            cluster.flush()
            before = sum(s["bytes_sent"] + s["bytes_received"] for s in cluster.stats())
            history = model.fit(
                x, np.ones((640, 1)), batch_size=64, epochs=1, verbose=0,
                callbacks=[ee.callbacks.Metrics()],
            )  # fmt: skip
            cluster.flush()
            after = sum(s["bytes_sent"] + s["bytes_received"] for s in cluster.stats())
            rows = len(emb.table)
        finally:
            ee.shutdown()
    per_step = (after - before) / 10
    logged = history.history["ee_bytes_per_step"][0]
    # The epoch's last push may land after the epoch ends: at most one push less.
    assert 0.85 * per_step < logged <= per_step
    assert history.history["ee_rows"] == [rows]
    assert history.history["ee_pull_ms"][0] > 0 and history.history["ee_push_ms"][0] > 0


def test_the_metrics_callback_reports_the_worker_caches_hit_rate():
    import keras

    with shards(1) as (ps,):
        cluster = ee.init(ps=[ps.address], mode="async", cache_rows=10_000, cache_staleness=3)
        try:
            model, _ = _model("cb_cache")
            x = np.random.default_rng(2).integers(0, 50, size=(640, 2))  # few ids: hot rows
            at_epoch_end = []
            history = model.fit(
                x, np.ones((640, 1)), batch_size=64, epochs=2, verbose=0,
                callbacks=[
                    ee.callbacks.Metrics(),
                    keras.callbacks.LambdaCallback(
                        on_epoch_end=lambda *_: at_epoch_end.append(cluster.cache.counts())
                    ),
                ],
            )  # fmt: skip
        finally:
            ee.shutdown()
    before, after = at_epoch_end
    delta = {k: after[k] - before[k] for k in ("served", "confirmed", "fetched")}
    expected = (delta["served"] + delta["confirmed"]) / sum(delta.values())
    rates = history.history["ee_cache_hit_rate"]
    assert rates[1] == pytest.approx(expected, rel=1e-9)
    assert 0 < rates[0] < rates[1] < 1  # the first epoch fetched every row once


def test_the_metrics_callback_refuses_a_bad_interval():
    with pytest.raises(ValueError, match="every"):
        ee.callbacks.Metrics(every=0)
