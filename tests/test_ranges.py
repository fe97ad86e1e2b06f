"""Splitting a shard's slot range (work in progress toward live resharding).

The right answer: a shard that never split, fed the same pushes; the two
halves' rows together must equal its rows, bit for bit, and a step re-sent to
both halves after the split is applied once.
"""

from __future__ import annotations

import numpy as np

import elastic_emb as ee
from elastic_emb import sharding
from elastic_emb.ps.shard import SYNC, Shard
from elastic_emb.table import TableConfig

CONFIG = TableConfig.make(dim=4, optimizer=ee.optimizers.Adam(0.01), name="t", seed=2).to_dict()


def _shard() -> Shard:
    shard = Shard()
    shard.create([CONFIG])
    for w in (0, 1):
        shard.join(w, 2, SYNC, -1)
    return shard


def _push(shard: Shard, worker: int, step: int, keys: np.ndarray) -> None:
    """Key k's gradient depends on (worker, step, k) only, however the keys are split."""
    grads = np.random.default_rng(100 * step + worker).normal(size=(400, 4))
    shard.push(worker, step, [("t", keys, grads[keys].astype(np.float32))])


def _rows(shards: list[Shard]) -> dict[int, np.ndarray]:
    out = {}
    for shard in shards:
        state = shard.table("t").export_state()
        out.update({int(k): v for k, v in zip(state.keys, state.values, strict=True)})
    return out


def test_a_split_mid_step_applies_every_push_once_as_an_unsplit_shard_does():
    keys = np.arange(400, dtype=np.int64)
    whole, left = _shard(), _shard()
    for shard in (whole, left):
        for step in (1, 2):
            _push(shard, 0, step, keys)
            _push(shard, 1, step, keys)
        _push(shard, 0, 3, keys)  # worker 1's push of step 3 has not arrived
    right = left.split((1000, sharding.NUM_SLOTS))
    left.keep_only((0, 1000))
    slots = sharding.slot_of(keys)
    for shard, inside in ((left, slots < 1000), (right, slots >= 1000)):
        _push(shard, 0, 3, keys[inside])  # re-sent after the split: applied once already
        _push(shard, 1, 3, keys[inside])
    _push(whole, 1, 3, keys)
    assert left.step() == right.step() == whole.step() == 3
    split, unsplit = _rows([left, right]), _rows([whole])
    assert split.keys() == unsplit.keys()
    for k in unsplit:
        np.testing.assert_array_equal(split[k], unsplit[k])
    assert all(sharding.slot_of(np.array(list(_rows([right])))) >= 1000)
