"""An elastic JAX worker with dense weights on the PS, for the exact-sum test.

Usage: python _exact_dense_worker.py COORDINATOR LOG NAME START_FILE [STEPS]. Connects
(`ee.init(coordinator=...)`, async: the dense weights go to the PS by default),
builds and compiles `model()`, prints "ready", waits until START_FILE exists, then
trains on the batches the job's `ShardQueue` hands it (one epoch), each step at
least STEP_SECONDS long; with STEPS, it leaves after that many (its shard goes back to
the queue, which the next holder resumes). It appends "handed NAME SHARD BATCH" to LOG as Keras
takes a batch (it may take some ahead) and "pushed NAME SHARD BATCH" once the
batch's step is pushed and acknowledged (every push of this worker applied by the
shards).

The model is linear in its weights, and its loss linear in its output, so each
batch's gradient does not depend on the weights (`gradients`): with SGD from zeros
every value on the PS is -LEARNING_RATE times the sum of the gradients applied,
in any order, exact in float32 (the gradients are multiples of 1/BATCH).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_ENABLE_X64", "1")

import numpy as np

SHARDS, BATCHES, BATCH = 6, 8, 4
LEARNING_RATE = 0.5
VOCABULARY = 12
FEATURES = 3
STEP_SECONDS = 0.15
TABLE = "exact_ids"
MODEL = "exact"


def read_shard(shard: int) -> list[tuple[tuple[np.ndarray, np.ndarray], np.ndarray]]:
    """The shard's batches: ((ids (BATCH, 2), features (BATCH, FEATURES)), labels (BATCH, 1)),
    small whole numbers."""
    rng = np.random.default_rng(shard)
    n = BATCHES * BATCH
    ids = rng.integers(0, VOCABULARY, (n, 2))
    features = rng.integers(-3, 4, (n, FEATURES)).astype(np.float32)
    labels = rng.integers(-2, 3, (n, 1)).astype(np.float32)
    return [
        ((ids[i : i + BATCH], features[i : i + BATCH]), labels[i : i + BATCH])
        for i in range(0, n, BATCH)
    ]


def gradients(shard: int, batch: int) -> dict[str, np.ndarray]:
    """The batch's gradient, by NumPy: the loss is mean(label * output), the output the
    sum of the ids' rows plus features @ kernel + bias."""
    (ids, features), labels = read_shard(shard)[batch]
    weight = labels[:, 0] / BATCH
    rows = np.zeros(VOCABULARY, np.float64)
    np.add.at(rows, ids[:, 0], weight)
    np.add.at(rows, ids[:, 1], weight)
    kernel = (features * weight[:, None]).sum(axis=0)
    return {"rows": rows, "kernel": kernel, "bias": np.array([weight.sum()])}


def model():
    import keras

    import elastic_emb as ee

    ids = keras.Input((2,), dtype="int64")
    features = keras.Input((FEATURES,))
    rows = ee.Embedding(1, optimizer=ee.optimizers.SGD(LEARNING_RATE), combiner="sum",
                        embeddings_initializer="zeros", name=TABLE)(ids)  # fmt: skip
    linear = keras.layers.Dense(1, kernel_initializer="zeros", name="linear")(features)
    out = keras.layers.Add()([rows, linear])
    model = keras.Model([ids, features], out, name=MODEL)
    model.compile(keras.optimizers.SGD(LEARNING_RATE), lambda y, p: y * p)
    return model


def main() -> int:
    import jax
    import keras

    import elastic_emb as ee
    from elastic_emb.shard_queue import ShardQueue

    coordinator, log, name, start_file = sys.argv[1:5]
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else None
    cluster = ee.init(coordinator=coordinator, mode="async")
    trained = model()
    # Keras 3.3 takes a generator's first batches to build an unbuilt optimizer,
    # and never trains them (its fit does not start the data again).
    trained.optimizer.build(trained.trainable_variables)
    queue = ShardQueue(coordinator, "exact", SHARDS, worker=name, lease_seconds=2)
    handed: list[tuple[int, int]] = []  # (shard, batch) of each batch, as Keras takes them

    def batches(shard: int):
        for number, batch in enumerate(read_shard(shard)):
            yield (shard, number), batch

    def write(what: str, where: tuple[int, int]) -> None:
        with open(log, "a") as f:
            f.write(f"{what} {name} {where[0]} {where[1]}\n")

    class Log(keras.callbacks.Callback):
        steps = 0

        def on_train_batch_begin(self, batch, logs=None):
            time.sleep(STEP_SECONDS)

        def on_train_batch_end(self, batch, logs=None):
            jax.effects_barrier()  # the step's host callbacks have run
            cluster.flush()  # and its push is acknowledged
            write("pushed", handed[self.steps])  # (Keras trains the batches as handed)
            self.steps += 1

    def tagged():
        for where, batch in queue.batches(lambda shard: list(batches(shard))):
            if len(handed) == steps:
                return
            handed.append(where)
            write("handed", where)
            yield batch

    print("ready", flush=True)
    while not os.path.exists(start_file):
        time.sleep(0.05)
    data = tagged()
    first = next(data, None)
    if first is not None:

        def all_batches():
            yield first
            yield from data

        trained.fit(all_batches(), callbacks=[queue.callback(), Log()], verbose=0)
    queue.close()
    ee.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
