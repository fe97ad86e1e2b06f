"""The disk tier (`ee.storage.Tiered`): a table far larger than its RAM budget trains
exactly like an all-in-RAM table, which is the reference for every test here."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

import elastic_emb as ee
from elastic_emb.tables.policies import optimizers as eo


def _pair(tmp_path: Path, name: str, ram_rows: int = 64, **kwargs) -> tuple[ee.Table, ee.Table]:
    """(an all-in-RAM table, its tiered twin with the same seed)."""
    common = {"optimizer": eo.Adagrad(0.1), "initializer": "uniform", "seed": 7, **kwargs}
    plain = ee.Table(4, name=f"{name}_ram", **common)
    tiered = ee.Table(
        4, name=f"{name}_tiered", storage=ee.storage.Tiered(ram_rows, str(tmp_path)), **common
    )
    return plain, tiered


def _steps(seed: int, n: int, num_keys: int = 3000) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (
            (rng.zipf(1.2, size=32) % num_keys).astype(np.int64),
            rng.normal(size=(32, 4)).astype(np.float32),
        )
        for _ in range(n)
    ]


def _assert_same_state(a: ee.Table, b: ee.Table) -> None:
    sa, sb = a.export_state(), b.export_state()
    oa, ob = np.argsort(sa.keys), np.argsort(sb.keys)
    for field in ("keys", "values", "slots", "last_step", "update_count"):
        np.testing.assert_array_equal(getattr(sa, field)[oa], getattr(sb, field)[ob], field)
    assert sa.iterations == sb.iterations
    assert len(a) == len(b)


def _train(plain: ee.Table, tiered: ee.Table, steps: list, ram_rows: int = 64) -> None:
    rng = np.random.default_rng(99)
    for keys, grads in steps:
        np.testing.assert_array_equal(tiered.pull(keys, train=True), plain.pull(keys, train=True))
        tiered.push(keys, grads)
        plain.push(keys, grads)
        assert tiered.tier_counts()["ram_rows"] <= ram_rows
        probe = rng.integers(0, 4000, size=16)  # evaluation: reads, never moves rows
        np.testing.assert_array_equal(
            tiered.pull(probe, train=False), plain.pull(probe, train=False)
        )


def test_a_table_far_larger_than_its_ram_trains_exactly_like_one_in_ram(tmp_path):
    plain, tiered = _pair(tmp_path, "big")
    _train(plain, tiered, _steps(0, 300))
    _assert_same_state(plain, tiered)
    counts = tiered.tier_counts()
    assert len(tiered) > 10 * 64  # most rows on disk
    assert counts["disk_rows"] == len(tiered) - counts["ram_rows"]
    assert counts["disk_hits"] > 0 and counts["ram_hits"] > counts["disk_hits"]  # Zipf: hot in RAM
    assert counts["demoted_rows"] >= counts["disk_rows"]
    keys = np.arange(-5, 3100)
    for got, want in zip(tiered.metadata(keys), plain.metadata(keys), strict=True):
        np.testing.assert_array_equal(got, want)


def test_rows_move_between_tiers_on_import_and_erase(tmp_path):
    plain, tiered = _pair(tmp_path, "moves", ram_rows=32)
    _train(plain, tiered, _steps(1, 40), ram_rows=32)
    keys = np.arange(0, 400, 3)
    values = np.random.default_rng(2).normal(size=(len(keys), 4)).astype(np.float32)
    for t in (plain, tiered):
        t.import_rows(keys, values)
        assert t.erase(np.arange(1, 400, 7)) > 0
    assert tiered.tier_counts()["ram_rows"] <= 32
    _assert_same_state(plain, tiered)
    _train(plain, tiered, _steps(3, 20), ram_rows=32)
    _assert_same_state(plain, tiered)


def test_checkpoints_hold_both_tiers_and_restore_anywhere(tmp_path):
    plain, tiered = _pair(tmp_path / "disk", "ckpt")
    _train(plain, tiered, _steps(4, 100))
    ee.save(tmp_path / "c", tables=[tiered])
    ee.placement.unregister(tiered)
    restored = ee.restore(tmp_path / "c")["ckpt_tiered"]  # created: tiered again
    assert restored.storage == tiered.storage
    _assert_same_state(tiered, restored)
    assert restored.tier_counts()["ram_rows"] <= 64
    _train(tiered, restored, _steps(5, 30))
    _assert_same_state(tiered, restored)
    with pytest.raises(NotImplementedError, match="disk tier"):
        ee.save(tmp_path / "inc", tables=[restored], incremental=True)


def test_the_disk_tier_is_scratch_removed_with_its_table(tmp_path):
    _, tiered = _pair(tmp_path, "scratch", ram_rows=16)
    tiered.push(np.arange(500), np.ones((500, 4), np.float32))
    directory = tiered.disk_directory
    assert Path(directory).parent == tmp_path and os.listdir(directory)
    del tiered  # the registry holds tables weakly
    gc.collect()
    assert not Path(directory).exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: ee.storage.Tiered(ram_rows=8, path=p), "ram_rows"),
        (lambda p: ee.storage.Tiered(ram_rows=100, path=""), "path"),
        (lambda p: ee.Table(4, name="bad", storage={"kind": "ssd"}), "storage"),
        (
            lambda p: ee.Table(4, name="bad", storage=ee.storage.Tiered(100, p),
                               eviction=ee.eviction.LRU(10)),
            "not both",
        ),
        (lambda p: ee.Table(4, name="bad", storage=ee.storage.Tiered(100, p), device="gpu"),
         "storage"),
    ],
)  # fmt: skip
def test_bad_tiers_are_refused(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        make(str(tmp_path))


def test_shards_keep_their_own_disk_tiers(tmp_path):
    from _cluster import shards

    plain = ee.Table(4, eo.Adagrad(0.1), name="shard_ram", seed=7)
    with shards(2) as ps:
        ee.init(ps=[s.address for s in ps], mode="sync")
        try:
            tiered = ee.Table(4, eo.Adagrad(0.1), name="shard_tiered", seed=7,
                              storage=ee.storage.Tiered(32, str(tmp_path)))  # fmt: skip
            for keys, grads in _steps(6, 60):
                np.testing.assert_array_equal(tiered.pull(keys), plain.pull(keys))
                tiered.push(keys, grads)
                plain.push(keys, grads)
            got = tiered.export_state()
            assert len(os.listdir(tmp_path)) == 2  # one database per shard
        finally:
            ee.shutdown()
    want = plain.export_state()
    g, w = np.argsort(got.keys), np.argsort(want.keys)
    np.testing.assert_array_equal(got.keys[g], want.keys[w])
    np.testing.assert_array_equal(got.values[g], want.values[w])
    np.testing.assert_array_equal(got.slots[g], want.slots[w])


def test_a_failed_background_write_is_raised_by_the_next_call_and_loses_nothing(tmp_path):
    plain, tiered = _pair(tmp_path, "diskfull", ram_rows=16)
    real_put = tiered._disk.put

    def full(state):
        raise OSError(28, "No space left on device")

    tiered._disk.put = full
    keys = np.arange(200)
    for t in (plain, tiered):
        t.push(keys, np.ones((200, 4), np.float32))
        t.push(keys[:20], np.ones((20, 4), np.float32))  # demotes 180 rows: the write fails
    with pytest.raises(OSError, match="No space left"):
        len(tiered)
    tiered._disk.put = real_put  # space again: the pending rows are written
    assert len(tiered) == 200
    _assert_same_state(plain, tiered)
