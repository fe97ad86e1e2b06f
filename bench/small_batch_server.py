"""What a small-batch training step costs one server, on each plane, against the table work.

The DLRM model of `step_overhead.py` (26 `ee.Embedding` features, Zipf ids,
dim 16, Adagrad), `model.fit` at batch `--batch` (64) against one
`elastic-emb serve`, async. Figure: the server's CPU per step (its threads'
on-CPU time, /proc schedstat), with Pull and Push on its data plane and
through gRPC (`ee.init(data_plane=...)`), each on a fresh server; windows of
`--steps` steps alternate between the planes. Reference, in the same rounds:
the table work of the same steps in-process (`_core.Table`): each step's
distinct ids of every feature pulled (train=True) and pushed once. The ratio
is the median over rounds of server CPU over that reference.

    python bench/small_batch_server.py [--batch 64] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine, markdown_table
from remote_bench import ps_shards
from server_path import cpu_seconds
from step_overhead import DIM, NUM_FEATURES, build, make_data

PLANES = ("native", "grpc")


def table_work(tables: list[Any], ids: list[np.ndarray], batch: int) -> float:
    """CPU seconds of the steps' distinct ids pulled and pushed on in-process tables."""
    start = time.process_time()
    for step in range(len(ids[0]) // batch):
        for table, column in zip(tables, ids, strict=True):
            keys = np.unique(column[step * batch : (step + 1) * batch])
            table.pull(keys, True)
            table.push(keys, np.full((len(keys), DIM), 1e-3, np.float32), 0.05, step + 1)
    return time.process_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200, help="steps per window")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import tensorflow as tf

    import elastic_emb as ee
    from elastic_emb import _core
    from elastic_emb.tables.local import core_options
    from elastic_emb.tables.table import TableConfig

    x, y = make_data(args.batch, args.steps)
    data = tf.data.Dataset.from_tensor_slices((tuple(x), y)).batch(args.batch).repeat()
    configs = [
        TableConfig.make(DIM, ee.optimizers.Adagrad(0.05), name=f"e{i}", seed=i)
        for i in range(NUM_FEATURES)
    ]
    local = [_core.Table(core_options(c)) for c in configs]
    cpu: dict[str, list[float]] = {k: [] for k in (*PLANES, "in-process")}
    with ps_shards(len(PLANES)) as servers:
        models = {}
        for plane, server in zip(PLANES, servers, strict=True):
            ee.init(ps=[server.address], mode="async", data_plane=plane)
            models[plane] = build("ee", NUM_FEATURES)
            models[plane].fit(data, epochs=1, steps_per_epoch=20, verbose=0)  # warm up
            ee.shutdown()
        table_work(local, x[:NUM_FEATURES], args.batch)
        for r in range(args.rounds):
            for plane in PLANES if r % 2 == 0 else PLANES[::-1]:
                server = servers[PLANES.index(plane)]
                ee.init(ps=[server.address], mode="async", data_plane=plane)
                try:
                    model = build("ee", NUM_FEATURES)  # its tables: the server's, as left
                    model.fit(data, epochs=1, steps_per_epoch=5, verbose=0)
                    before = cpu_seconds(server.process.pid)
                    model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
                    time.sleep(0.05)
                    cpu[plane].append((cpu_seconds(server.process.pid) - before) / args.steps)
                finally:
                    ee.shutdown()
            seconds = table_work(local, x[:NUM_FEATURES], args.batch)
            cpu["in-process"].append(seconds / args.steps)
    del models
    rows = []
    for plane in PLANES:
        ratios = [a / b for a, b in zip(cpu[plane], cpu["in-process"], strict=True)]
        rows.append(
            [
                f"{args.batch} x {NUM_FEATURES}",
                {"native": "data plane", "grpc": "gRPC plane"}[plane],
                f"{1e3 * statistics.median(cpu[plane]):.2f}",
                f"{1e3 * statistics.median(cpu['in-process']):.2f}",
                f"{statistics.median(ratios):.2f}x",
                ", ".join(f"{r:.2f}" for r in ratios),
            ]
        )
    print(f"\n## Server CPU per small-batch step ({machine()})\n")
    print(
        markdown_table(
            [
                "batch x tables",
                "plane",
                "server CPU ms/step",
                "in-process table work ms/step",
                "ratio (median)",
                "rounds",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
