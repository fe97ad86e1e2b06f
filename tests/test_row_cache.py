"""The worker's cache of remote rows (`ee.init(cache_rows=..., cache_staleness=...)`).

The reference is the same run without a cache: with `cache_staleness=0` every
pull must return exactly its rows, and with staleness S a served row must be
the row the shards held at most S steps before. Real `elastic-emb serve`
shards on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
from _cluster import shards

import elastic_emb as ee
from elastic_emb.ps.client.row_cache import RowCache


@contextlib.contextmanager
def _cluster(**kwargs) -> Iterator:
    with shards(2) as ps:
        cluster = ee.init(ps=[s.address for s in ps], mode="async", **kwargs)
        try:
            yield cluster
        finally:
            ee.shutdown()


def _received(cluster) -> int:
    return sum(s["bytes_received"] for s in cluster.stats())


def _steps(seed: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [(rng.zipf(1.3, size=64) % 400).astype(np.int64) for _ in range(n)]
    return [(k, rng.normal(size=(64, 4)).astype(np.float32)) for k in keys]


def _run(evaluations: int = 0, **cache) -> tuple[list[np.ndarray], object, dict, int]:
    """Trains a table on two shards; returns every pulled batch, the final state, the
    cache counts and the bytes the shards sent for the evaluation pulls at the end
    (after a first one)."""
    with _cluster(**cache) as cluster:
        t = ee.Table(4, ee.optimizers.Adagrad(0.1), name="cached", seed=1)
        pulled = []
        for keys, grads in _steps(0, 40):
            pulled.append(t.pull(keys, train=True))
            t.push(keys, grads)
        probe = np.arange(400)
        pulled.append(t.pull(probe, train=False))  # all rows, pushes applied
        before = _received(cluster)
        for _ in range(evaluations):  # nothing changes between these reads
            pulled.append(t.pull(probe, train=False))
        received = _received(cluster) - before
        counts = cluster.cache.counts() if cluster.cache is not None else {}
        return pulled, t.export_state(), counts, received


def test_staleness_0_pulls_exactly_the_rows_of_no_cache_in_fewer_bytes():
    plain, plain_state, _, plain_bytes = _run(evaluations=2)
    cached, cached_state, counts, cached_bytes = _run(evaluations=2, cache_rows=1000)
    assert len(plain) == len(cached)
    for a, b in zip(plain, cached, strict=True):
        np.testing.assert_array_equal(a, b)
    a, b = np.argsort(plain_state.keys), np.argsort(cached_state.keys)
    np.testing.assert_array_equal(plain_state.values[a], cached_state.values[b])
    np.testing.assert_array_equal(plain_state.slots[a], cached_state.slots[b])
    # The second and third reads of unchanged rows came back as bits (ids
    # never pushed have no version and come back whole each time).
    assert counts["confirmed"] > 0 and counts["served"] == 0
    assert cached_bytes < 0.5 * plain_bytes, (cached_bytes, plain_bytes)


def test_staleness_s_serves_rows_at_most_s_steps_old():
    keys = np.arange(10)
    with _cluster(cache_rows=100, cache_staleness=2) as cluster:
        t = ee.Table(2, ee.optimizers.SGD(1.0), initializer="zeros", name="stale", seed=0)
        t.push(keys, np.ones((10, 2), np.float32))  # rows exist, version 1
        seen = []
        for _ in range(5):
            seen.append(t.pull(keys)[0, 0])
            t.push(keys, np.ones((10, 2), np.float32))
        counts = cluster.cache.counts()
    # Fetched at step 2 (value -1); served at steps 3 and 4; at step 5 older
    # than 2 steps: asked again (-4), then served at step 6.
    assert seen == [-1.0, -1.0, -1.0, -4.0, -4.0]
    assert counts["served"] == 30 and counts["fetched"] == 20


def test_the_cache_keeps_its_row_budget_and_the_most_pulled_rows():
    cache = RowCache(capacity=50, staleness=0)
    hot = np.arange(20)
    for step in range(1, 30):
        cold = np.arange(1000 + 40 * step, 1000 + 40 * step + 40)
        keys = np.concatenate([hot, cold])
        served, _, held, held_rows = cache.plan("t", 2, keys, step)
        assert not served.any()
        rows = np.full((len(keys), 2), step, np.float32)
        versions = np.full(len(keys), step, np.uint64)
        unchanged = held == versions  # nothing changes from a step to the next here
        rows[unchanged] = 0
        cache.answer("t", keys, rows, versions, unchanged, held_rows, step)
        cache.fit(step)
        assert len(cache) <= 50
    rows_cached = cache._tables["t"].keys
    assert set(hot) <= set(rows_cached.tolist())  # pulled every step: kept


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cache_rows": -1}, "cache_rows"),
        ({"cache_rows": 10, "cache_staleness": 1.5}, "cache_staleness"),
        ({"cache_staleness": 2}, "cache_rows > 0"),
        ({"cache_rows": 10, "cache_staleness": 2, "mode": "sync"}, "mode 'async'"),
    ],
)
def test_bad_cache_arguments_are_refused(kwargs, message):
    with shards(1) as ps, pytest.raises(ValueError, match=message):
        ee.init(ps=[ps[0].address], **{"mode": "async", **kwargs})
    ee.shutdown()
