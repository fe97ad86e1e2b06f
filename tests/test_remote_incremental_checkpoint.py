"""Incremental checkpoints of tables on PS shards, and the step a cluster checkpoint is cut at.

The right answers come from elsewhere than the code under test: an
in-process table trained with the same steps (restores must equal it bit for
bit), and the keys the steps touched (a delta holds exactly those rows: a
pull inserts, a push updates).
"""

from __future__ import annotations

import contextlib
import gc
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import _shards
import numpy as np
import pytest
from _cluster import shards
from _states import assert_same_state, sorted_state

import elastic_emb as ee
from elastic_emb.persistence import checkpoint
from elastic_emb.ps.server.shard import SYNC, RequestError, Shard
from elastic_emb.tables.table import TableConfig

VOCAB = 2000


@contextlib.contextmanager
def _connected(n: int, mode: str) -> Iterator[None]:
    """`n` shards, and this process connected to them in `mode` (stale tables collected first)."""
    with shards(n) as servers:
        gc.collect()
        ee.init(ps=[s.address for s in servers], mode=mode)
        try:
            yield
        finally:
            ee.shutdown()


def _table(name: str) -> ee.Table:
    return ee.Table(8, optimizer=ee.optimizers.Adam(0.01), name=name, seed=5)


def _keys(step: int, n: int) -> np.ndarray:
    return np.unique(np.random.default_rng(step).integers(0, VOCAB, n))


def _train(table: ee.Table, steps: range, n: int) -> None:
    for step in steps:
        keys = _keys(step, n)
        rows = table.pull(keys)
        table.push(keys, (rows * 0.5 + 0.01 * step).astype(np.float32))


def _state(table: ee.Table) -> dict[str, np.ndarray]:
    return sorted_state(table.export_state())


def _parts(root: Path) -> list[dict]:
    manifest = json.loads((root / "manifest.json").read_text())
    return [json.loads((root / p / "manifest.json").read_text()) for p in manifest["parts"]]


def _expected(name: str, *runs: tuple[range, int]) -> dict[str, np.ndarray]:
    """The state an in-process table reaches with the same steps (it is gone afterwards)."""
    table = _table(name)
    for steps, n in runs:
        _train(table, steps, n)
    state = _state(table)
    del table
    gc.collect()
    return state


def _restored(root: Path, name: str) -> dict[str, np.ndarray]:
    gc.collect()  # the remote tables of the closed connection are gone
    return _state(ee.restore(root)[name])


def test_shards_write_deltas_of_the_rows_the_steps_touched_and_restore_exactly(tmp_path):
    expected = _expected("t", (range(1, 11), 500), (range(11, 13), 10))
    root = tmp_path / "ckpt"
    with _connected(2, "sync"):
        table = _table("t")
        _train(table, range(1, 11), 500)
        ee.save(root, incremental=True)
        (base,) = _parts(root)[0]["tables"]["t"]["links"]
        _train(table, range(11, 13), 10)
        ee.save(root, incremental=True)
        ee.save(tmp_path / "full")  # for the sizes
        del table
    touched = np.unique(np.concatenate([_keys(s, 10) for s in (11, 12)]))
    links = [part["tables"]["t"]["links"] for part in _parts(root)]
    assert [len(chain) for chain in links] == [2, 2]
    assert [chain[1]["kind"] for chain in links] == ["delta", "delta"]
    assert sum(chain[1]["num_rows"] for chain in links) == len(touched)
    assert links[0][0]["sha256"] == base["sha256"]  # the base was kept, not rewritten
    full = sum(p["tables"]["t"]["bytes"] for p in _parts(tmp_path / "full"))
    assert sum(chain[1]["bytes"] for chain in links) < full / 10
    cut = json.loads((root / "manifest.json").read_text())["cut"]
    assert cut["mode"] == "sync" and cut["steps"] == [12, 12]
    assert cut["worker_steps"] == [{"0": 12}, {"0": 12}]
    assert_same_state(_restored(root, "t"), expected)


def test_shards_that_own_other_slots_start_new_chains(tmp_path):
    root = tmp_path / "ckpt"
    expected = _expected("moved", (range(1, 8), 200))
    for n, steps in ((2, range(1, 6)), (3, range(6, 8))):
        with _connected(n, "async"):
            table = _table("moved")
            if n == 3:
                ee.restore(root)
            _train(table, steps, 200)
            ee.save(root, incremental=True)
            del table
    # Three shards own other slots than two did: every part is a new base.
    assert [len(p["tables"]["moved"]["links"]) for p in _parts(root)] == [1, 1, 1]
    assert_same_state(_restored(root, "moved"), expected)


SGD_TABLE = TableConfig.make(dim=2, optimizer=ee.optimizers.SGD(1.0), name="t", seed=1).to_dict()


def _sync_shard(workers: int) -> Shard:
    shard = Shard()
    shard.create([SGD_TABLE])
    for w in range(workers):
        shard.join(w, workers, SYNC, -1)
    return shard


def test_a_sync_save_waits_for_its_step_to_be_applied_everywhere(tmp_path):
    shard = _sync_shard(2)
    keys, ones = np.array([7]), np.ones((1, 2), np.float32)
    _shards.push(shard, 0, 1, [("t", keys, ones)])  # worker 1's push of step 1 has not arrived
    saved: list = []
    saver = threading.Thread(
        target=lambda: saved.append(shard.save(str(tmp_path), [], after_step=1))
    )
    saver.start()
    saver.join(0.5)
    assert saver.is_alive()  # waiting for step 1
    _shards.push(shard, 1, 1, [("t", keys, 2 * ones)])
    saver.join(30)
    rows, step, worker_steps = saved[0]
    assert (rows, step, worker_steps) == (1, 1, {0: 1, 1: 1})
    (state,) = checkpoint.read_shards([tmp_path], ["t"])[1].values()
    initial = Shard().create([SGD_TABLE])[0].pull(keys)  # the same seeded row
    np.testing.assert_array_equal(state.values, initial - 3.0)  # SGD, lr 1: both gradients


def test_a_sync_save_that_waits_too_long_names_the_late_workers(tmp_path):
    shard = _sync_shard(3)
    _shards.push(shard, 0, 1, [("t", np.array([1]), np.ones((1, 2), np.float32))])
    with pytest.raises(RequestError, match=r"workers \[1, 2\] have not pushed it") as raised:
        shard.save(str(tmp_path), [], after_step=1, timeout=0.2)
    assert raised.value.code == "DEADLINE_EXCEEDED"
    assert not (tmp_path / "manifest.json").exists()


def test_a_held_sync_save_applies_no_later_step_until_it_is_written(tmp_path, monkeypatch):
    shard = _sync_shard(2)
    keys, ones = np.array([3]), np.ones((1, 2), np.float32)
    for worker in (0, 1):
        _shards.push(shard, worker, 1, [("t", keys, ones)])
    writing, written = threading.Event(), threading.Event()
    real_save = checkpoint.save

    def slow_save(*args, **kwargs):
        writing.set()
        assert written.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save", slow_save)
    saver = threading.Thread(target=lambda: shard.save(str(tmp_path), [], after_step=1, hold=True))
    saver.start()
    assert writing.wait(30)
    for worker in (0, 1):  # step 2 is complete, and held
        _shards.push(shard, worker, 2, [("t", keys, ones)])
    assert shard.step() == 1
    with pytest.raises(RequestError, match="another save holds step 1"):
        shard.save(str(tmp_path / "other"), [], after_step=1, hold=True)
    # Every worker pushed step 2, but a pull of step 3 must still wait for it to be applied.
    pulled: list = []
    puller = threading.Thread(
        target=lambda: pulled.append(_shards.pull(shard, 0, 3, True, 30.0, [("t", keys)]))
    )
    puller.start()
    puller.join(0.5)
    assert puller.is_alive() and not pulled
    with pytest.raises(RequestError, match="a checkpoint holds step 1 back"):
        _shards.pull(shard, 1, 3, True, 0.1, [("t", keys)])
    written.set()
    saver.join(30)
    puller.join(30)
    assert shard.step() == 2  # applied once the save was written
    (state,) = checkpoint.read_shards([tmp_path], ["t"])[1].values()
    initial = Shard().create([SGD_TABLE])[0].pull(keys)
    np.testing.assert_array_equal(state.values, initial - 2.0)  # step 1 only
    (rows,) = pulled[0]
    np.testing.assert_array_equal(rows, initial - 4.0)  # steps 1 and 2
    with pytest.raises(RequestError, match="cannot hold at step 1: step 2 is applied"):
        shard.save(str(tmp_path), [], after_step=1, hold=True)


def _chain(root: Path, name: str) -> list[dict]:
    manifest = json.loads((root / "manifest.json").read_text())
    return manifest["tables"][name]["links"]


def _wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (OSError, KeyError, ValueError):  # not written yet
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:g} s: {what}")
        time.sleep(0.05)


def test_a_server_writes_periodic_deltas_and_nothing_while_idle(tmp_path):
    expected = _expected("p", (range(1, 6), 300), (range(6, 9), 10))
    iterations = [5, 8]
    d = tmp_path / "server"
    with shards(1, ["--checkpoint-dir", str(d), "--checkpoint-every", "0.2"]) as (server,):
        gc.collect()
        ee.init(ps=[server.address], mode="async")
        try:
            table = _table("p")
            _train(table, range(1, 6), 300)
            _wait_for(lambda: _chain(d, "p")[-1]["iterations"] == iterations[0], "step 5 saved")
            _train(table, range(6, 9), 10)
            _wait_for(lambda: _chain(d, "p")[-1]["iterations"] == iterations[1], "step 8 saved")
            links = _chain(d, "p")
            time.sleep(1.0)  # five idle periods
            assert _chain(d, "p") == links
            del table
        finally:
            ee.shutdown()
        server.stop(signal.SIGKILL)
    assert links[0]["kind"] == "base" and len(links) >= 2
    assert all(link["kind"] == "delta" and link["num_rows"] > 0 for link in links[1:])
    touched = np.unique(np.concatenate([_keys(s, 10) for s in (6, 7, 8)]))
    assert sum(link["num_rows"] for link in links[1:]) >= len(touched)
    assert_same_state(_restored(d, "p"), expected)


def test_the_keras_checkpoint_callback_writes_deltas_of_tables_on_shards(tmp_path):
    keras = pytest.importorskip("keras")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 400, (256, 3)).astype(np.int64)
    y = rng.normal(size=(256, 1)).astype(np.float32)
    states = []
    with _connected(2, "sync"):
        layer = ee.Embedding(4, optimizer=ee.optimizers.Adagrad(0.3), name="cb")
        inp = keras.Input((3,), dtype="int64")
        model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(layer(inp))))
        model.compile(optimizer="sgd", loss="mse")

        class Snapshot(keras.callbacks.Callback):  # after Checkpoint: what it saved
            def on_epoch_end(self, epoch, logs=None):
                states.append(_state(layer.table))

        callback = ee.callbacks.Checkpoint(tmp_path, incremental=True, max_to_keep=2)
        model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=[callback, Snapshot()])
    saved = sorted(tmp_path.glob("ckpt-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in saved] == ["ckpt-8", "ckpt-12"]
    for i, ckpt in enumerate(saved):
        kinds = [
            [link["kind"] for link in p["tables"]["cb"]["links"]] for p in _parts(ckpt / "tables")
        ]
        assert kinds == [["base"] + ["delta"] * (i + 1)] * 2  # both shards' parts
        assert_same_state(_restored(ckpt / "tables", "cb"), states[i + 1])


def test_in_process_tables_beside_remote_ones_get_their_own_chain(tmp_path):
    expected_remote = _expected("r", (range(1, 4), 100), (range(4, 6), 10))
    local = _table("beside")  # created before ee.init: it stays in this process
    root = tmp_path / "ckpt"
    with _connected(2, "sync"):
        remote = _table("r")
        for steps, n in ((range(1, 4), 100), (range(4, 6), 10)):
            _train(local, steps, n)
            _train(remote, steps, n)
            ee.save(root, incremental=True)
        del remote
    expected_local = _state(local)
    parts = _parts(root)
    assert [sorted(p["tables"]) for p in parts] == [["r"], ["r"], ["beside"]]
    assert [link["kind"] for link in parts[2]["tables"]["beside"]["links"]] == ["base", "delta"]
    assert_same_state(_restored(root, "r"), expected_remote)
    local.push(np.array([1]), np.ones((1, 8), np.float32))  # restore must undo this
    assert_same_state(_restored(root, "beside"), expected_local)
