"""Elastic sync steps at one shard: a worker the shard counted as gone (its lease lapsed)
joins again and pushes the steps applied without it. Every push is applied once; the
right answer is the sum of every gradient pushed (SGD, exact in float32)."""

from __future__ import annotations

import _shards
import numpy as np

import elastic_emb as ee
from elastic_emb.ps.server.shard import SYNC, Shard
from elastic_emb.tables.table import TableConfig

LEARNING_RATE = 0.125
KEYS = np.arange(6, dtype=np.int64)


def _shard(workers: int = 2) -> Shard:
    shard = Shard()
    config = TableConfig.make(4, ee.optimizers.SGD(LEARNING_RATE), "zeros", "t", 0)
    shard.create([config.to_dict()])
    for w in range(workers):
        shard.join(w, 1, SYNC, -1, elastic=True)
    return shard


def _gradient(worker: int, step: int) -> np.ndarray:
    """Whole numbers: every sum is exact, in any order."""
    return np.full((len(KEYS), 4), 1 + worker + 10 * step, np.float32)


def _push(shard: Shard, worker: int, step: int) -> int:
    return _shards.push(shard, worker, step, [("t", KEYS, _gradient(worker, step))])


def _rows(shard: Shard) -> np.ndarray:
    return _shards.pull(shard, 0, shard.step() + 1, False, 1.0, [("t", KEYS)])[0]


def _expected(pushes: list[tuple[int, int]]) -> np.ndarray:
    return -LEARNING_RATE * sum(_gradient(w, s) for w, s in pushes)


def test_a_worker_joining_again_pushes_the_steps_applied_without_it():
    shard = _shard()
    _push(shard, 0, 1), _push(shard, 1, 1)
    shard.leave(1)  # its lease lapsed: the shard counts it as gone
    assert _push(shard, 0, 2) == 2  # step 2 is applied without worker 1
    assert _push(shard, 0, 3) == 3  # and step 3
    # Worker 1 was in the middle of step 2: it joins again and goes on from its own step.
    assert shard.join(1, 1, SYNC, -1, elastic=True, again=True) == 3
    assert shard.worker_steps() == {0: 3, 1: 1}
    np.testing.assert_array_equal(_rows(shard), _expected([(0, 1), (1, 1), (0, 2), (0, 3)]))
    assert _push(shard, 1, 2) == 3  # applied on its own, at once
    assert _push(shard, 1, 2) == 3  # sent again (a failover): taken once
    np.testing.assert_array_equal(_rows(shard), _expected([(0, 1), (1, 1), (0, 2), (0, 3), (1, 2)]))
    _push(shard, 1, 3)
    # Step 4 waits for both workers again.
    assert _push(shard, 0, 4) == 3
    assert _push(shard, 1, 4) == 4
    pushes = [(w, s) for s in (1, 2, 3, 4) for w in (0, 1)]
    np.testing.assert_array_equal(_rows(shard), _expected(pushes))


def test_a_restarted_worker_continues_from_the_shards_step():
    """Without `again` (a new process of the same worker): it continues from the shard's
    step, and a push of an applied step is a re-send, taken once already."""
    shard = _shard()
    _push(shard, 0, 1), _push(shard, 1, 1)
    shard.leave(1)
    _push(shard, 0, 2)
    assert shard.join(1, 1, SYNC, -1, elastic=True) == 2
    assert shard.worker_steps() == {0: 2, 1: 2}
    _push(shard, 1, 2)
    np.testing.assert_array_equal(_rows(shard), _expected([(0, 1), (1, 1), (0, 2)]))


def test_a_late_push_waits_for_a_holding_save_and_travels_with_a_copy():
    """A save holding step 2 keeps the late push out of the tables it writes; a copy of the
    shard made meanwhile (a new backup) applies it at once, the holder when the save ends:
    both before any later step, so both end equal."""
    shard = _shard()
    _push(shard, 0, 1), _push(shard, 1, 1)
    shard.leave(1)
    _push(shard, 0, 2)
    shard.join(1, 1, SYNC, -1, elastic=True, again=True)
    assert shard._clock.hold_at(2)
    _push(shard, 1, 2)
    held = _expected([(0, 1), (1, 1), (0, 2)])
    np.testing.assert_array_equal(_rows(shard), held)  # held back with the steps
    copy = _shard(0)
    copy.table("t").load_state(shard.table("t").export_state())
    copy.install(copy.tables(), *shard.export_steps())
    with_late = _expected([(0, 1), (1, 1), (0, 2), (1, 2)])
    np.testing.assert_array_equal(_rows(copy), with_late)
    shard._clock.release_hold()
    np.testing.assert_array_equal(_rows(shard), with_late)
    for replica in (shard, copy):
        _push(replica, 0, 3), _push(replica, 1, 3)
    pushes = [(w, s) for s in (1, 2, 3) for w in (0, 1)]
    np.testing.assert_array_equal(_rows(shard), _expected(pushes))
    np.testing.assert_array_equal(_rows(copy), _expected(pushes))
