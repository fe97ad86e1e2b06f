"""The per-step cost of `ee.Embedding` layers over the dense network alone (issue 11's ceiling).

Two models in one process, trained with `model.fit` in interleaved rounds:
`--tables` features of Zipf ids (100,000 per feature) through `ee.Embedding`
(dim 16, Adagrad), and the same model whose embeddings are a gather from a
small frozen matrix (no table, no optimizer, no transfer: the ceiling of any
embedding layer). Both have 13 dense features and the MLP 512-256-1. Prints,
per round, the ratio of their seconds per step, as wall time and as this
process's CPU time (steadier on a shared machine), and the medians.

    python bench/step_overhead.py [--tables 26] [--batch 4096] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import elastic_emb as ee

VOCAB, DIM, FROZEN_ROWS, STEPS = 100_000, 16, 1000, 20


def build(kind: str, tables: int) -> keras.Model:
    ids = [keras.Input((1,), dtype="int64") for _ in range(tables)]
    dense = keras.Input((13,))
    features = []
    for i, x in enumerate(ids):
        if kind == "ee":
            layer = ee.Embedding(DIM, ee.optimizers.Adagrad(0.05), name=f"e{i}")
        else:
            layer = keras.layers.Embedding(FROZEN_ROWS, DIM, name=f"e{i}", trainable=False)
            x = keras.ops.mod(x, FROZEN_ROWS)
        features.append(keras.layers.Flatten()(layer(x)))
    h = keras.layers.Concatenate()([*features, dense])
    for units in (512, 256):
        h = keras.layers.Dense(units, activation="relu")(h)
    model = keras.Model([*ids, dense], keras.layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="binary_crossentropy")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.batch * STEPS
    ids = [np.minimum(rng.zipf(1.2, (n, 1)) - 1, VOCAB - 1) for _ in range(args.tables)]
    x = [*ids, rng.normal(size=(n, 13)).astype(np.float32)]
    y = rng.integers(0, 2, (n, 1)).astype(np.float32)
    models = {kind: build(kind, args.tables) for kind in ("ceiling", "ee")}

    def step_seconds(model: keras.Model) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
        return (time.perf_counter() - wall) / STEPS, (time.process_time() - cpu) / STEPS

    for model in models.values():
        step_seconds(model)  # trace and warm up
    print(f"{args.tables} tables, batch {args.batch}: ee.Embedding / ceiling, per step\n")
    print("| round | ceiling ms (wall) | ee ms (wall) | wall ratio | cpu ratio |")
    print("| --- | --- | --- | --- | --- |")
    wall_ratios, cpu_ratios = [], []
    for r in range(args.rounds):
        (cw, cc), (ew, ec) = step_seconds(models["ceiling"]), step_seconds(models["ee"])
        wall_ratios.append(ew / cw)
        cpu_ratios.append(ec / cc)
        print(f"| {r + 1} | {1e3 * cw:.1f} | {1e3 * ew:.1f} | {ew / cw:.2f} | {ec / cc:.2f} |")
    print(
        f"\nMedian ratio: wall {statistics.median(wall_ratios):.2f}, "
        f"CPU {statistics.median(cpu_ratios):.2f} (issue 11's target: <= 1.15)"
    )


if __name__ == "__main__":
    main()
