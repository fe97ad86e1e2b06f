"""Elastic workers sharing a job's data queue: per-worker examples/s, with and without a slow
worker, in async and bounded-staleness modes.

A cluster of real servers (etcd, `elastic-emb serve --coordinator`, R=1) and
three worker processes that take their data from one `ShardQueue` (dense
weights on the PS, no all-reduce). One run per (mode, slow worker) pair:
every worker equal, then worker "slow" sleeping --delay seconds per batch
(a straggler). Per worker: the batches it trained and its examples/s over
its own `fit`; per run: the job's wall time.

    python bench/elastic_bench.py [--shards 24] [--batches 20] [--delay 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

BATCH = 512


def worker(args: argparse.Namespace) -> None:
    """One worker process: trains from the queue, prints its figures as JSON."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import elastic_emb as ee
    from elastic_emb.shard_queue import ShardQueue

    ee.init(coordinator=args.coordinator, mode="async", staleness=args.staleness)
    keras.utils.set_random_seed(0)
    ids = keras.Input((4,), dtype="int64")
    embedded = [ee.Embedding(16, name=f"f{i}")(ids[:, i]) for i in range(4)]
    hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()(embedded))
    model = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(hidden), name="bench")
    model.compile(keras.optimizers.Adagrad(0.05), "binary_crossentropy")

    def read_shard(shard: int) -> list[tuple[np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(shard)
        x = rng.integers(0, 100_000, (args.batches * BATCH, 4))
        y = (x[:, :1] % 3 == 0).astype(np.float32)
        return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]

    class Straggler(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            time.sleep(args.delay)

    queue = ShardQueue(args.coordinator, args.job, args.shards, epochs=1, worker=args.name)
    start = time.perf_counter()
    queue.fit(model, read_shard, callbacks=[Straggler()], verbose=0)
    seconds = time.perf_counter() - start
    queue.close()
    ee.shutdown()
    batches = len(queue.trained)
    print(json.dumps({"name": args.name, "batches": batches, "seconds": seconds,
                      "examples/s": batches * BATCH / seconds}))  # fmt: skip


def run(cluster: object, args: argparse.Namespace, staleness: int | None, slow: bool) -> dict:
    job = f"job-{staleness}-{slow}-{time.monotonic_ns()}"
    procs = []
    started = time.perf_counter()
    for name in ("fast-1", "fast-2", "slow" if slow else "fast-3"):
        command = [sys.executable, __file__, "--worker", "--coordinator",
                   cluster.coordinator, "--job", job, "--name", name,  # type: ignore[attr-defined]
                   "--shards", str(args.shards), "--batches", str(args.batches),
                   "--delay", str(args.delay if name == "slow" else 0.0)]  # fmt: skip
        if staleness is not None:
            command += ["--staleness", str(staleness)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL}
        procs.append(subprocess.Popen(command, text=True, **pipes))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode:
            raise RuntimeError(f"a worker failed ({proc.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {"wall": time.perf_counter() - started, "workers": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--staleness", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=int, default=24, help="data shards in the job")
    parser.add_argument("--batches", type=int, default=20, help=f"batches of {BATCH} per shard")
    parser.add_argument("--delay", type=float, default=0.1, help="the slow worker's sleep/batch")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from elastic_emb.ps.coord.local_cluster import LocalCluster

    cpu = platform.processor() or platform.machine()
    print(f"# Elastic workers on one queue ({os.cpu_count()} cores, {cpu}, no GPU)\n")
    print(f"3 workers, {args.shards} shards x {args.batches} batches of {BATCH}, 1 epoch, "
          f"4 ee.Embedding(16) + Dense(64); dense weights on the PS; 1 server group (R=1), "
          f"a fresh one per mode. "
          f"The slow worker sleeps {args.delay} s after each batch.\n")  # fmt: skip
    print("| mode | workers | worker | batches | examples/s | job wall s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for staleness in (None, 2):  # a cluster each: its servers keep the mode of their workers
        mode = "async" if staleness is None else f"bounded staleness {staleness}"
        with LocalCluster(1, 1) as cluster:
            for slow in (False, True):
                result = run(cluster, args, staleness, slow)
                label = "2 fast + 1 slow" if slow else "3 equal"
                for w in result["workers"]:
                    rate = f"{w['examples/s']:,.0f}"
                    print(f"| {mode} | {label} | {w['name']} | {w['batches']} | {rate} | "
                          f"{result['wall']:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
