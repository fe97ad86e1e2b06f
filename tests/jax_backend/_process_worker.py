"""One JAX process of test_jax_processes.py: `python _process_worker.py INDEX COUNT
COORDINATOR PS OUT`. Trains the small model on shards in sync mode under
keras.distribution.DataParallel, on its part of each global batch; process 0 saves the
losses, rows, dense weights and the shards' call counts to OUT (.npz)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

STEPS, LOCAL_BATCH = 8, 16  # per epoch; each process's part of a global batch


def global_batches(processes: int) -> tuple[np.ndarray, np.ndarray]:
    """The data, in global batches of `processes * LOCAL_BATCH` (the processes' parts in
    process order)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 100, (STEPS * LOCAL_BATCH * processes, 2))
    y = rng.integers(0, 2, (len(x), 1)).astype(np.float32)
    return x, y


def main(index: int, count: int, coordinator: str, ps: str, out: str) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_ENABLE_X64"] = "1"
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: _small_model
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # (JAX 0.5: no default)
    jax.distributed.initialize(coordinator, count, index)
    # After initialize: Keras lists the devices of every process.
    import keras
    from _small_model import small_model, sorted_rows
    from jax.experimental import multihost_utils

    import elastic_emb as ee

    x, y = global_batches(count)
    part = np.arange(len(x)).reshape(STEPS, count, LOCAL_BATCH)[:, index].ravel()
    workers = {}
    if not hasattr(jax.distributed, "is_initialized"):  # (JAX 0.5.0: no default from JAX)
        workers = {"worker_index": index, "num_workers": count}
    cluster = ee.init(ps=ps.split(","), mode="sync", **workers)
    assert cluster is not None
    assert (cluster.worker_index, cluster.num_workers) == (index, count)
    # Each process passes its own part of the data.
    keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
    model = small_model("jax_procs")
    history = model.fit(
        x[part], y[part], batch_size=LOCAL_BATCH, epochs=2, shuffle=False, verbose=0
    )
    cluster.flush()
    multihost_utils.sync_global_devices("every push sent")  # (sync: every step applied)
    if index == 0:
        arrays = {"loss": np.array(history.history["loss"])}
        for method in ("Pull", "Push"):
            arrays[method] = np.array(
                [m.calls for s in cluster.server_stats() for m in s.methods if m.method == method]
            )
        for name in ("jax_procs_a", "jax_procs_b"):
            table = model.get_layer(name).table
            arrays[f"{name}_keys"], arrays[f"{name}_rows"] = sorted_rows(table)
            arrays[f"{name}_iterations"] = np.array(table.iterations)
        # Called outside a step, a layer looks its ids up in this process alone.
        keys = arrays["jax_procs_a_keys"][:3]
        arrays["looked_up"] = np.asarray(model.get_layer("jax_procs_a")(keys, training=False))
        for i, weight in enumerate(model.layers[-1].get_weights()):  # the Dense layer
            arrays[f"dense_{i}"] = weight
        np.savez(out, **arrays)
    multihost_utils.sync_global_devices("saved")
    ee.shutdown()


if __name__ == "__main__":
    index, count, coordinator, ps, out = sys.argv[1:]
    main(int(index), int(count), coordinator, ps, out)
