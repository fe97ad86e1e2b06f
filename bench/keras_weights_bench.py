"""What `model.get_weights()` / `set_weights()` cost when they carry a table's rows.

`get_weights()` gives, at an `ee.Embedding`'s place, a copy of its table (keys,
rows, optimizer slots, row metadata: `elastic_emb.keras.weights`), as Keras gives
a stock `keras.layers.Embedding`'s matrix. Side by side, in one process, for a
table of `--rows` rows of width `--dim`:

- `ee`: an `ee.Embedding` with Adagrad holding that many rows (imported);
- `stock`: `keras.layers.Embedding(rows, dim)`, whose only weight is the matrix
  (Keras's Adagrad keeps its accumulator in the compile optimizer, which
  `get_weights` does not copy).

For each: the bytes one `get_weights()` result holds (per row), the RSS it adds
while held, and the CPU time of `get_weights()` and of `set_weights()` with it,
medians over `--rounds` interleaved rounds. Prints a Markdown table.

    python bench/keras_weights_bench.py [--rows 1000000,4000000] [--dim 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import elastic_emb as ee


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _model(kind: str, rows: int, dim: int) -> keras.Model:
    ids = keras.Input((1,), dtype="int64")
    if kind == "ee":
        layer = ee.Embedding(dim, optimizer=ee.optimizers.Adagrad(0.05), name=f"bench_{rows}")
    else:
        layer = keras.layers.Embedding(rows, dim)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    if kind == "ee":
        values = np.random.default_rng(0).normal(size=(rows, dim)).astype(np.float32)
        layer.table.import_rows(np.arange(rows, dtype=np.int64), values)
    return model


def _held_bytes(weights: list[Any]) -> int:
    total = 0
    for w in weights:
        rows = getattr(w, "rows", None)
        total += w.nbytes + (rows.nbytes if rows is not None else 0)
    return total


def _measure(model: keras.Model) -> dict[str, float]:
    gc.collect()
    before = _rss()
    start = time.process_time()
    weights = model.get_weights()
    get_cpu = time.process_time() - start
    grown = _rss() - before
    start = time.process_time()
    model.set_weights(weights)
    set_cpu = time.process_time() - start
    held = _held_bytes(weights)
    del weights
    return {"get": get_cpu, "set": set_cpu, "held": held, "rss": grown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000000,4000000")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, no GPU")
    print(f"Keras {keras.__version__} ({keras.backend.backend()}), dim {args.dim}, "
          f"medians of {args.rounds} interleaved rounds\n")  # fmt: skip
    print("| rows | variant | bytes held per row | RSS added per row | get_weights CPU ms "
          "| set_weights CPU ms |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in (int(r) for r in args.rows.split(",")):
        models = {kind: _model(kind, rows, args.dim) for kind in ("ee", "stock")}
        runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in models}
        for _ in range(args.rounds):
            for kind, model in models.items():
                runs[kind].append(_measure(model))
        for kind, measured in runs.items():
            med = {k: statistics.median(m[k] for m in measured) for k in measured[0]}
            print(f"| {rows:,} | {kind} | {med['held'] / rows:.1f} | {med['rss'] / rows:.1f} "
                  f"| {med['get'] * 1e3:.1f} | {med['set'] * 1e3:.1f} |")  # fmt: skip
        ratio = {
            k: statistics.median(
                a[k] / b[k] for a, b in zip(runs["ee"], runs["stock"], strict=True)
            )
            for k in ("get", "set", "held")
        }
        print(f"| {rows:,} | ee / stock | {ratio['held']:.2f}× | | {ratio['get']:.2f}× "
              f"| {ratio['set']:.2f}× |")  # fmt: skip
        del models
        gc.collect()


if __name__ == "__main__":
    main()
