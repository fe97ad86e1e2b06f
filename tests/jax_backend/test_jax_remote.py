"""ee.Embedding on JAX against real `elastic-emb serve` shards: training is bit for bit
the in-process run's, one Pull and one Push per shard per step for all tables, sync and
async."""

import keras
import numpy as np
import pytest
from _cluster import shards
from _small_model import small_model, sorted_rows

import elastic_emb as ee
from elastic_emb.ps.client.remote_table import RemoteTable

STEPS = 16


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_worker_on_shards_trains_exactly_as_in_process(mode):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 300, (64 * STEPS // 2, 2))
    y = rng.integers(0, 2, (len(x), 1)).astype(np.float32)
    local = small_model("jax_exact")
    local_loss = local.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    with shards(2) as ps:
        cluster = ee.init(ps=[s.address for s in ps], mode=mode)
        try:
            model = small_model("jax_exact")
            loss = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
            assert loss.history["loss"] == local_loss.history["loss"]
            for name in ("jax_exact_a", "jax_exact_b"):
                remote, here = model.get_layer(name).table, local.get_layer(name).table
                assert isinstance(remote, RemoteTable)
                assert remote.iterations == here.iterations == STEPS
                for got, want in zip(sorted_rows(remote), sorted_rows(here), strict=True):
                    np.testing.assert_array_equal(got, want)
            for weight, local_weight in zip(model.get_weights(), local.get_weights(), strict=True):
                np.testing.assert_array_equal(weight, local_weight)
            # The rows of both tables come in one Pull per shard per step (the model's
            # lookups fused), and their gradients go in one Push per shard.
            for stats in cluster.server_stats():
                calls = {m.method: m.calls for m in stats.methods}
                assert calls["Pull"] == STEPS and calls["Push"] == STEPS, calls
        finally:
            ee.shutdown()


def test_loss_scaling_with_tables_on_shards_is_refused():
    """A step Keras skips would leave the shards waiting for its pushes (as on TensorFlow)."""
    x, y = np.arange(8).reshape(4, 2), np.zeros((4, 1), np.float32)
    with shards(1) as ps:
        ee.init(ps=[ps[0].address], mode="async")
        keras.config.set_dtype_policy("mixed_float16")
        try:
            model = small_model("jax_scaled")
            with pytest.raises(ValueError, match=r"in-process tables only.*jax_scaled_"):
                model.fit(x, y, verbose=0)
            assert model.get_layer("jax_scaled_a").table.iterations == 0
        finally:
            keras.config.set_dtype_policy("float32")
            ee.shutdown()
