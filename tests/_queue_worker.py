"""One elastic worker for the shard-queue tests: takes its data from `ShardQueue`.

Usage: python _queue_worker.py COORDINATOR LOG NAME [--kill-at K]. Trains a small
model (dense weights on the PS) on 8 shards x 8 batches of 64 examples, 2 epochs,
and appends "epoch shard batch name worker-index" to LOG after each trained batch. --kill-at K:
SIGKILL itself as its K-th batch (0-based) starts. Each step takes at least
--step-seconds (default 50 ms), so that the workers share the shards.
"""

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import elastic_emb as ee
from elastic_emb.shard_queue import ShardQueue

parser = argparse.ArgumentParser()
parser.add_argument("coordinator")
parser.add_argument("log")
parser.add_argument("name")
parser.add_argument("--kill-at", type=int)
parser.add_argument("--start-after", help="wait until this file exists before training")
parser.add_argument("--step-seconds", type=float, default=0.05, help="least time of a step")
args = parser.parse_args()

SHARDS, BATCHES, BATCH = 8, 8, 64


def read_shard(shard: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(shard)
    ids = rng.integers(0, 1000, (BATCHES * BATCH, 2))
    labels = (ids[:, :1] % 3 == 0).astype(np.float32)
    return [(ids[i : i + BATCH], labels[i : i + BATCH]) for i in range(0, len(ids), BATCH)]


def main() -> int:
    cluster = ee.init(coordinator=args.coordinator, mode="async")  # takes a free worker index
    keras.utils.set_random_seed(0)
    ids = keras.Input((2,), dtype="int64")
    x = ee.Embedding(8, optimizer=ee.optimizers.Adagrad(0.1), name="queue_ids")(ids[:, 0])
    model = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(x), name="queue")
    model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
    queue = ShardQueue(args.coordinator, "test", SHARDS, epochs=2, worker=args.name,
                       lease_seconds=2)  # fmt: skip

    class Log(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(args.step_seconds)

        def on_train_batch_end(self, batch, logs=None):
            epoch, shard, number = queue.trained[-1]
            with open(args.log, "a") as f:
                f.write(f"{epoch} {shard} {number} {args.name} {cluster.worker_index}\n")

    while args.start_after and not os.path.exists(args.start_after):
        time.sleep(0.05)
    queue.fit(model, read_shard, callbacks=[Log()], verbose=0)
    queue.close()
    ee.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
