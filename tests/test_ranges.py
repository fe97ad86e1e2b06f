"""Moving a part of a shard's slot range (`Shard.export_range`, `Shard.shrink`, a scale-out).

The right answer: a shard that never split, fed the same pushes; the two
halves' rows together must equal its rows, bit for bit, and a step re-sent to
both halves after the split is applied once.
"""

from __future__ import annotations

import threading
import time

import _shards
import numpy as np
from _states import assert_same_state, sorted_state

import elastic_emb as ee
from elastic_emb._proto import ps_pb2
from elastic_emb.ps.server.replication import _Snapshot
from elastic_emb.ps.server.request_error import RequestError
from elastic_emb.ps.server.shard import SYNC, Shard
from elastic_emb.ps.wire import protocol
from elastic_emb.tables import sharding
from elastic_emb.tables.local import LocalTable
from elastic_emb.tables.table import TableConfig

CONFIG = TableConfig.make(dim=4, optimizer=ee.optimizers.Adam(0.01), name="t", seed=2).to_dict()


def _shard() -> Shard:
    shard = Shard()
    shard.create([CONFIG])
    for w in (0, 1):
        shard.join(w, 2, SYNC, -1)
    return shard


def _grads(worker: int, step: int) -> np.ndarray:
    """Key k's gradient depends on (worker, step, k) only, however the keys are split."""
    return np.random.default_rng(100 * step + worker).normal(size=(400, 4)).astype(np.float32)


def _push(shard: Shard, worker: int, step: int, keys: np.ndarray) -> None:
    _shards.push(shard, worker, step, [("t", keys, _grads(worker, step)[keys])])


def _rows(shards: list[Shard]) -> dict[int, np.ndarray]:
    out = {}
    for shard in shards:
        state = shard.table("t").export_state()
        out.update({int(k): v for k, v in zip(state.keys, state.values, strict=True)})
    return out


def test_moving_part_of_a_range_mid_step_applies_every_push_once():
    """As a move does it: the snapshot of slots [1000, end) of a shard in the middle of a
    sync step, a change forwarded (cut to those slots), the shrink at the cutover, and the
    step sent again after it. The two shards must equal one that never split, bit for bit."""
    n = sharding.NUM_SLOTS
    keys = np.arange(400, dtype=np.int64)
    whole, left = _shard(), _shard()
    left.slots = (0, n)
    for shard in (whole, left):
        for step in (1, 2):
            _push(shard, 0, step, keys)
            _push(shard, 1, step, keys)
        _push(shard, 0, 3, keys)  # worker 1's push of step 3 has not arrived
    tables, steps, pending = left.export_range((1000, n))
    right = Shard((1000, n))
    for config, state in tables:  # (the move sends these in parts)
        right.create([config])[0].add_state(state)
    right.install(right.tables(), steps, pending)
    # Worker 1's step 3 reaches the source during the move, and its part is forwarded.
    push = protocol.push_request(1, 3, ps_pb2.FLOAT32, [("t", keys, _grads(1, 3)[keys])])
    left.push(protocol.push_message(push))
    part = protocol.restricted("Push", push, (1000, n), right.table)
    right.push(protocol.push_message(part))
    left.shrink(1000)
    assert (left.slots, right.slots) == ((0, 1000), (1000, n))
    slots = sharding.slot_of(keys)
    for shard, inside in ((left, slots < 1000), (right, slots >= 1000)):
        _push(shard, 0, 3, keys[inside])  # sent again after the cutover: applied once already
        _push(shard, 1, 3, keys[inside])
    _push(whole, 1, 3, keys)
    assert left.step() == right.step() == whole.step() == 3
    split, unsplit = _rows([left, right]), _rows([whole])
    assert split.keys() == unsplit.keys()
    for k in unsplit:
        np.testing.assert_array_equal(split[k], unsplit[k])
    assert all(sharding.slot_of(np.array(list(_rows([right])))) >= 1000)
    assert all(sharding.slot_of(np.array(list(_rows([left])))) < 1000)
    assert left.table("t").iterations == right.table("t").iterations == whole.table("t").iterations


def test_a_range_snapshot_in_parts_reads_back_exactly():
    """Several tables, each in several parts (as MoveIn and InstallSnapshot send them)."""
    shard = _shard()
    other = TableConfig.make(dim=3, optimizer=ee.optimizers.Adagrad(0.1), name="u", seed=5)
    shard.create([other.to_dict()])
    keys = np.arange(400, dtype=np.int64)
    shard.table("t").pull(keys)  # rows to copy
    _push(shard, 0, 1, keys)  # worker 1 has not pushed: step 1 is pending
    shard.table("u").push(keys[:50], np.ones((50, 3), np.float32))
    snapshot = _Snapshot.take(7, shard, (0, 2000))
    chunks = list(snapshot.chunks({"group": 0, "epoch": 1}, per_part=16))
    assert len(chunks) > 10
    (read,) = _Snapshot.read(chunks).items()
    assert read[0] == 7 and read[1].slots == (0, 2000)
    inside = sharding.slot_of(keys) < 2000
    for name in ("t", "u"):
        got = sorted_state(read[1].table(name).export_state())
        want = shard.table(name).export_state()
        assert_same_state(got, sorted_state(want.select(sharding.slot_of(want.keys) < 2000)))
    assert read[1].export_steps()[0] == shard.export_steps()[0]
    ((worker, step, parts),) = read[1].export_steps()[1]
    assert (worker, step) == (0, 1) and np.array_equal(parts[0][1], keys[inside])


def test_the_core_exports_and_erases_a_slot_range_as_slot_of_says():
    """C++ `export_slots` / `erase_slots` against NumPy `sharding.slot_of` (negative keys too)."""
    table = LocalTable(TableConfig.make(dim=4, optimizer=ee.optimizers.Adagrad(0.1), name="s"))
    keys = np.arange(-3000, 3000, dtype=np.int64) * 7919
    table.push(keys, np.ones((len(keys), 4), np.float32))
    full = table.export_state()
    slots = sharding.slot_of(full.keys)
    inside = (slots >= 1000) & (slots < 3000)
    assert 0 < inside.sum() < len(keys)
    assert_same_state(
        sorted_state(table.export_slots((1000, 3000))), sorted_state(full.select(inside))
    )
    assert table.erase_slots((1000, 3000)) == inside.sum()
    assert_same_state(sorted_state(table.export_state()), sorted_state(full.select(~inside)))


def test_a_pull_waiting_across_a_shrink_is_refused_and_inserts_nothing_there():
    """A sync pull checked its keys, then waited for its step while the range's upper
    slots moved away: it is refused (the worker splits it again), and no row of the moved
    slots stays behind on the source (its backup never had one)."""
    n = sharding.NUM_SLOTS
    shard = _shard()
    shard.slots = (0, n)
    keys = np.arange(400, dtype=np.int64)
    _push(shard, 0, 1, keys[:10])  # worker 0 pushed step 1; worker 1 has not
    outcome: list[BaseException | None] = []

    def pull() -> None:
        try:
            _shards.pull(shard, 0, 2, True, 30.0, [("t", np.arange(1000, 1400, dtype=np.int64))])
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    waiting = threading.Thread(target=pull)
    waiting.start()
    time.sleep(0.3)  # the pull of step 2 waits for step 1
    shard.shrink(n // 2)
    _push(shard, 1, 1, keys[:10][sharding.slot_of(keys[:10]) < n // 2])
    waiting.join(30)
    (error,) = outcome
    assert isinstance(error, RequestError) and error.code == "OUT_OF_RANGE"
    stored = shard.table("t").export_state().keys
    assert (sharding.slot_of(stored) < shard.slots[1]).all()
