"""Admission and eviction (`ee.admission`, `ee.eviction`) against a NumPy reference.

The reference keeps exact counts, so the tables under test get sketches far
larger than their keys need: with a few hundred keys, no key shares all its
counters with others, and the sketch counts exactly. The sketch's
over-counting is tested on its own, against its documented estimate.

SGD with learning rate 0.5, zeros initialization and integer gradients keeps
every value exact in float32, so rows compare with `==`.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import elastic_emb as ee
from elastic_emb.persistence import checkpoint
from elastic_emb.tables.local import LocalTable
from elastic_emb.tables.table import TableConfig

DIM = 3
LR = 0.5
BIG_SKETCH = 1 << 20


class Reference:
    """What a table with these policies holds, by the documented rules."""

    def __init__(self, min_count: int = 1, eviction: object = None) -> None:
        self.min_count = min_count
        self.eviction = eviction
        self.values: dict[int, np.ndarray] = {}
        self.last_use: dict[int, int] = {}  # pushed, or pulled for training (+1)
        self.last_step: dict[int, int] = {}
        self.updates: dict[int, int] = {}
        self.counts: Counter[int] = Counter()
        self.step = 0
        self.evicted = 0

    def _insert(self, key: int) -> None:
        self.values[key] = np.zeros(DIM, np.float32)
        self.updates[key] = self.last_step[key] = self.last_use[key] = 0

    def pull(self, keys: np.ndarray) -> np.ndarray:
        out = np.zeros((len(keys), DIM), np.float32)
        for i, k in enumerate(keys.tolist()):
            if k not in self.values and self.min_count <= 1:
                self._insert(k)
            if k in self.values:
                out[i] = self.values[k]
                self.last_use[k] = self.step + 1
        return out

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        self.step += 1
        sums: dict[int, np.ndarray] = {}
        for k, g in zip(keys.tolist(), grads, strict=True):
            sums[k] = sums[k] + g if k in sums else g.copy()
        for k, g in sums.items():
            if k not in self.values:
                self.counts[k] += 1
                if self.counts[k] < self.min_count:
                    continue
                self._insert(k)
            self.values[k] = self.values[k] - np.float32(LR) * g
            self.last_use[k] = self.last_step[k] = self.step
            self.updates[k] += 1
        self._evict()

    def _evict(self) -> None:
        ev, t = self.eviction, self.step
        if ev is None:
            return
        protected_from = t - ev.protect_steps + 1
        if isinstance(ev, ee.eviction.TTL):
            if t % max(1, ev.steps // 4):
                return
            gone = [
                k
                for k in self.values
                if self.last_step[k] < t - ev.steps and self.last_use[k] < protected_from
            ]
        else:
            if len(self.values) <= ev.max_rows:
                return
            candidates = [k for k in self.values if self.last_use[k] < protected_from]
            if isinstance(ev, ee.eviction.LFU):
                candidates.sort(key=lambda k: (self.updates[k], self.last_step[k], k))
            else:
                candidates.sort(key=lambda k: (self.last_step[k], k))
            gone = candidates[: len(self.values) - (ev.max_rows - ev.max_rows // 16)]
        for k in gone:
            del self.values[k], self.last_use[k], self.last_step[k], self.updates[k]
        self.evicted += len(gone)


def _table(name: str, **policies: object) -> ee.Table:
    return ee.Table(DIM, ee.optimizers.SGD(LR), initializer="zeros", name=name, seed=0, **policies)


def _rows(table: ee.Table) -> dict[int, np.ndarray]:
    keys, values = table.export_rows()
    return dict(zip(keys.tolist(), values, strict=True))


def _assert_same(table: ee.Table, ref: Reference) -> None:
    rows = _rows(table)
    assert sorted(rows) == sorted(ref.values)
    for k, v in ref.values.items():
        np.testing.assert_array_equal(rows[k], v, err_msg=f"key {k}")
    assert table.policy_counts()["evicted_rows"] == ref.evicted


def _steps(seed: int, n: int, num_keys: int = 300) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batches of Zipf-like ids (duplicates included) with integer gradients."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        keys = (rng.zipf(1.3, size=24) % num_keys).astype(np.int64)
        out.append((keys, rng.integers(-4, 5, size=(24, DIM)).astype(np.float32)))
    return out


def _train(table: ee.Table, ref: Reference, steps: list, extra_pulls: bool = True) -> None:
    rng = np.random.default_rng(1)
    for keys, grads in steps:
        np.testing.assert_array_equal(table.pull(keys, train=True), ref.pull(keys))
        if extra_pulls:  # rows pulled for training but not pushed count as used too
            extra = rng.integers(0, 300, size=4).astype(np.int64)
            np.testing.assert_array_equal(table.pull(extra, train=True), ref.pull(extra))
        table.push(keys, grads)
        ref.push(keys, grads)
        _assert_same(table, ref)


@pytest.mark.parametrize("min_count", [2, 3])
def test_admission_gives_rows_from_the_nth_step_an_id_occurs_in(min_count):
    policy = ee.admission.Frequency(min_count=min_count, sketch_bytes=BIG_SKETCH)
    table = _table(f"adm{min_count}", admission=policy)
    ref = Reference(min_count=min_count)
    _train(table, ref, _steps(0, 40))
    counts = table.policy_counts()
    assert counts["admitted_keys"] == len(ref.values)
    assert 0 < len(ref.values) < len(ref.counts)  # some ids waited, some never made it
    # Counted once per step: an id 24 times in one push is still not admitted.
    table.push(np.full(24, 10_000), np.ones((24, DIM), np.float32))
    assert table.metadata(np.array([10_000]))[0][0] == -1
    # Evaluation never inserts, and unadmitted ids read their initial value.
    np.testing.assert_array_equal(table.pull(np.array([10_001]), train=False), np.zeros((1, 3)))


@pytest.mark.parametrize(
    "policy",
    [
        ee.eviction.TTL(steps=6),
        ee.eviction.LRU(max_rows=40),
        ee.eviction.LFU(max_rows=40),
        ee.eviction.LRU(max_rows=40, protect_steps=3),
    ],
    ids=["ttl", "lru", "lfu", "lru-protect3"],
)
def test_eviction_keeps_the_rows_the_reference_keeps(policy):
    table = _table("ev", eviction=policy)
    ref = Reference(eviction=policy)
    _train(table, ref, _steps(2, 60))
    assert ref.evicted > 50
    if not isinstance(policy, ee.eviction.TTL) and policy.protect_steps == 1:
        assert len(table) <= policy.max_rows  # (3 steps' rows can outnumber max_rows)


def test_admission_and_eviction_together():
    admission = ee.admission.Frequency(min_count=2, sketch_bytes=BIG_SKETCH)
    eviction = ee.eviction.LFU(max_rows=30)
    table = _table("both", admission=admission, eviction=eviction)
    ref = Reference(min_count=2, eviction=eviction)
    _train(table, ref, _steps(3, 60))
    assert ref.evicted > 0


def test_rows_a_step_uses_are_never_evicted_even_beyond_max_rows():
    table = _table("wide", eviction=ee.eviction.LRU(max_rows=10))
    keys = np.arange(25, dtype=np.int64)
    table.pull(keys, train=True)
    table.push(keys, np.ones((25, DIM), np.float32))
    assert len(table) == 25  # all used by this step: protected
    table.pull(keys[:5], train=True)  # the next step uses 5 of them
    table.push(keys[:3], np.ones((3, DIM), np.float32))
    # Down to 10 rows: the 5 used (2 pulled only), then of the others
    # (all last updated at step 1) the larger keys.
    assert sorted(_rows(table)) == [0, 1, 2, 3, 4, 20, 21, 22, 23, 24]


def test_the_sketch_overcounts_no_more_than_its_documented_estimate():
    policy = ee.admission.Frequency(min_count=2, sketch_bytes=1 << 14, sketch_depth=4)
    table = _table("sketch", admission=policy)
    ids = np.random.default_rng(0).permutation(10**6)[:6000].astype(np.int64)
    for chunk in np.split(ids, 60):  # every id occurs once
        table.push(chunk, np.ones((len(chunk), DIM), np.float32))
    # Ids pushed late met the fullest sketch: 5,000 ids counted before them.
    late = ids[5000:]
    rate = np.count_nonzero(table.metadata(late)[0] >= 0) / len(late)
    estimate = policy.false_admission_rate(len(ids))
    assert 0 < rate <= estimate, (rate, estimate)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ee.admission.Frequency(min_count=0), "min_count"),
        (lambda: ee.admission.Frequency(min_count=256), "min_count"),
        (lambda: ee.admission.Frequency(sketch_depth=9), "sketch_depth"),
        (lambda: ee.eviction.LRU(max_rows=0), "max_rows"),
        (lambda: ee.eviction.LFU(max_rows=1.5), "max_rows"),
        (lambda: ee.eviction.TTL(steps=-1), "steps"),
        (lambda: ee.eviction.TTL(steps=5, protect_steps=0), "protect_steps"),
        (lambda: _table("bad", admission="frequency"), "admission"),
        (lambda: _table("bad", eviction={"kind": "fifo"}), "eviction"),
        (lambda: _table("bad", admission=ee.admission.Frequency(sketch_bytes=100)), "sketch_bytes"),
        (lambda: _table("bad", eviction=ee.eviction.LRU(10), device="gpu"), "device='gpu'"),
    ],
)
def test_bad_policies_are_refused_clearly(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _trained(name: str, **policies: object) -> tuple[ee.Table, list]:
    table = _table(name, **policies)
    _train(table, Reference(**_reference_args(policies)), _steps(4, 20))
    return table, _steps(5, 20)


def _reference_args(policies: dict) -> dict:
    admission = policies.get("admission")
    min_count = admission.min_count if admission else 1
    return {"min_count": min_count, "eviction": policies.get("eviction")}


POLICIES = {
    "admission": ee.admission.Frequency(min_count=2, sketch_bytes=BIG_SKETCH),
    "eviction": ee.eviction.LRU(max_rows=40),
}


def _continue_both(a: ee.Table, b: ee.Table, steps: list) -> None:
    for keys, grads in steps:
        np.testing.assert_array_equal(a.pull(keys, train=True), b.pull(keys, train=True))
        a.push(keys, grads)
        b.push(keys, grads)
    assert sorted(_rows(a)) == sorted(_rows(b))
    for k, v in _rows(a).items():
        np.testing.assert_array_equal(_rows(b)[k], v)
    np.testing.assert_array_equal(a.export_state().counts, b.export_state().counts)


@pytest.mark.parametrize("incremental", [False, True])
def test_checkpoints_keep_the_policies_and_the_counts(tmp_path: Path, incremental):
    table, more = _trained("saved", **POLICIES)
    ee.save(tmp_path / "ckpt", tables=[table], incremental=incremental)
    if incremental:  # a delta on top of the base
        table.push(*more[0])
        ee.save(tmp_path / "ckpt", tables=[table], incremental=True)
        more = more[1:]
    expected = table.export_state()
    ee.checkpoint.unregister(table)
    restored = ee.restore(tmp_path / "ckpt")["saved"]  # created from the checkpoint
    assert restored.admission == POLICIES["admission"]
    assert restored.eviction == POLICIES["eviction"]
    np.testing.assert_array_equal(restored.export_state().counts, expected.counts)
    assert restored.export_state().counts.sum() > 0
    _continue_both(table, restored, more)


def test_restore_refuses_a_sketch_of_another_shape_and_changes_nothing(tmp_path: Path):
    table, _ = _trained("shape", **POLICIES)
    ee.save(tmp_path / "ckpt", tables=[table])
    other = _table("shape", admission=ee.admission.Frequency(sketch_bytes=BIG_SKETCH // 2))
    other.push(np.array([1, 1]), np.ones((2, DIM), np.float32))
    before = other.export_state().counts.copy()
    with pytest.raises(ee.CheckpointError, match="admission sketch"):
        ee.restore(tmp_path / "ckpt", tables=[other])
    np.testing.assert_array_equal(other.export_state().counts, before)


def test_concurrent_pulls_and_pushes_respect_the_row_limit():
    table = _table(
        "busy",
        admission=ee.admission.Frequency(min_count=2, sketch_bytes=BIG_SKETCH),
        eviction=ee.eviction.LFU(max_rows=200),
    )
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for keys, grads in _steps(seed, 200, num_keys=5000):
                table.pull(keys, train=True)
                table.push(keys, grads)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    table.push(np.array([0]), np.zeros((1, DIM), np.float32))  # one more pass, alone
    counts = table.policy_counts()
    assert len(table) <= 200
    assert counts["evicted_rows"] > 0
    # Every admitted id is either still a row or was evicted (re-admissions
    # count again), and the table's rows are distinct keys.
    keys, _ = table.export_rows()
    assert len(np.unique(keys)) == len(keys) == len(table)
    assert counts["admitted_keys"] == len(table) + counts["evicted_rows"]


def test_checkpoint_entries_without_policies_read_as_before():
    entry = {"dim": 2, "seed": 0, "optimizer": {}, "initializer": {}, "num_slots": 0}
    assert set(checkpoint.table_config("t", entry)) == {
        "name", "dim", "seed", "optimizer", "initializer"
    }  # fmt: skip


@pytest.fixture
def two_shards():
    """`ee.init` on two real `elastic-emb serve` shards (sync); disconnects and stops them."""
    from _cluster import connected_shards

    with connected_shards(2):
        yield


def test_shards_apply_the_policies_to_their_own_rows(two_shards, tmp_path: Path):
    """Admission and TTL act per row, so the shards hold what one table does; LRU's
    max_rows holds per shard: each shard is its own reference."""
    from elastic_emb.tables import sharding

    admission = ee.admission.Frequency(min_count=2, sketch_bytes=BIG_SKETCH)
    ttl = _table("remote_ttl", admission=admission, eviction=ee.eviction.TTL(steps=6))
    lru = _table("remote_lru", eviction=ee.eviction.LRU(max_rows=20))
    assert type(ttl).__name__ == "RemoteTable"
    ttl_ref = Reference(min_count=2, eviction=ttl.eviction)
    lru_refs = [Reference(eviction=lru.eviction) for _ in range(2)]
    rng = np.random.default_rng(1)
    for keys, grads in _steps(6, 40):
        extra = rng.integers(0, 300, size=4).astype(np.int64)
        for batch in (keys, extra):
            np.testing.assert_array_equal(ttl.pull(batch, train=True), ttl_ref.pull(batch))
            lru.pull(batch, train=True)
            for i, ref in enumerate(lru_refs):
                ref.pull(batch[sharding.shard_of(batch, 2) == i])
        ttl.push(keys, grads)
        ttl_ref.push(keys, grads)
        lru.push(keys, grads)
        for i, ref in enumerate(lru_refs):
            mine = sharding.shard_of(keys, 2) == i
            ref.push(keys[mine], grads[mine])
    _assert_same(ttl, ttl_ref)
    merged = Reference()
    for ref in lru_refs:
        merged.values.update(ref.values)
        merged.evicted += ref.evicted
    _assert_same(lru, merged)
    assert ttl.policy_counts()["admitted_keys"] == len(ttl_ref.values) + ttl_ref.evicted

    # Saved from two shards, restored into this process: the shards' sketches
    # add up to the one an in-process table counted.
    local = LocalTable(
        TableConfig.make(DIM, ee.optimizers.SGD(LR), "zeros", "local_twin", 0, "raise",
                         admission, ee.eviction.TTL(steps=6))
    )  # fmt: skip
    for keys, grads in _steps(6, 40):
        local.push(keys, grads)
    ee.save(tmp_path / "ckpt", tables=[ttl])
    ee.shutdown()
    restored = ee.restore(tmp_path / "ckpt")["remote_ttl"]
    assert type(restored).__name__ == "LocalTable"
    np.testing.assert_array_equal(restored.export_state().counts, local.export_state().counts)
    _continue_both(local, restored, _steps(7, 10))


def test_keras_saves_and_loads_the_policies_and_counts(tmp_path: Path):
    import keras

    admission = ee.admission.Frequency(min_count=2, sketch_bytes=BIG_SKETCH)
    eviction = ee.eviction.LFU(max_rows=150)
    ids = keras.Input(shape=(4,), dtype="int64")
    emb = ee.Embedding(4, name="kp_emb", admission=admission, eviction=eviction)
    out = keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids)))
    model = keras.Model(ids, out)
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).zipf(1.2, size=(512, 4)) % 2000
    model.fit(x, np.ones((512, 1)), batch_size=32, epochs=2, verbose=0)
    counts = emb.table.policy_counts()
    assert counts["rejected_updates"] > 0 and counts["evicted_rows"] > 0
    assert 0 < len(emb.table) <= 150
    state = emb.table.export_state()
    model.save(tmp_path / "m.keras")

    loaded = keras.models.load_model(tmp_path / "m.keras")
    table = loaded.get_layer("kp_emb").table
    assert (table.admission, table.eviction) == (admission, eviction)
    again = table.export_state()
    np.testing.assert_array_equal(again.counts, state.counts)
    assert sorted(again.keys.tolist()) == sorted(state.keys.tolist())


def test_a_range_snapshot_in_parts_carries_the_counts_once():
    """Backups and slot moves get a table in parts; the table-wide counts must not be
    added up once per part."""
    from elastic_emb.ps.server.replication import _Snapshot
    from elastic_emb.ps.server.shard import Shard

    shard = Shard()
    config = TableConfig.make(DIM, ee.optimizers.SGD(LR), "zeros", "snap", 0, "raise",
                              POLICIES["admission"])  # fmt: skip
    (table,) = shard.create([config.to_dict()])
    for keys, grads in _steps(8, 20):
        table.push(keys, grads)
    chunks = list(_Snapshot.take(3, shard).chunks({"group": 0, "epoch": 1}, per_part=4))
    assert len(chunks) > 5
    (copy,) = _Snapshot.read(chunks).values()
    want = table.export_state()
    got = copy.table("snap").export_state()
    assert want.counts.sum() > 0
    np.testing.assert_array_equal(got.counts, want.counts)
    assert sorted(got.keys.tolist()) == sorted(want.keys.tolist())
