"""ee.DistributedEmbedding against keras-rs's DistributedEmbedding, training side by side.

Eight features, each with its own table (Adagrad 0.05, dim 16, mean combiner,
(batch, 4) Zipf ids), a 256-128-1 MLP on the concatenated embeddings, batch
4096, `model.fit` windows. keras-rs on CPU falls back to dense
`keras.layers.Embedding` tables sized to `vocabulary_size` (and trains them
with the compile optimizer: Adagrad 0.05 too); elastic_emb keeps growing
hash tables trained sparsely by each table config's optimizer. The two
variants train in turns (A, B, A, B ...); the ratio is the median of
per-round ratios.

    python bench/keras_rs_bench.py [--quick] [--vocab 100000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import _common as c

FEATURES = 8
IDS_PER_EXAMPLE = 4
DIM = 16


def build(kind: str, vocab: int, keras_rs, keras, ee):
    tables = [
        keras_rs.layers.TableConfig(
            f"{kind}_t{i}", vocabulary_size=vocab, embedding_dim=DIM, combiner="mean",
            optimizer=keras.optimizers.Adagrad(0.05),
            initializer=keras.initializers.RandomUniform(-0.05, 0.05),
        )
        for i in range(FEATURES)
    ]  # fmt: skip
    configs = {
        f"f{i}": keras_rs.layers.FeatureConfig(
            f"f{i}", t, (c.BATCH_SIZE, IDS_PER_EXAMPLE), (c.BATCH_SIZE, DIM)
        )
        for i, t in enumerate(tables)
    }
    layer = (
        ee.DistributedEmbedding(configs)
        if kind == "ee"
        else keras_rs.layers.DistributedEmbedding(configs)
    )
    inputs = {k: keras.Input((IDS_PER_EXAMPLE,), dtype="int64", name=k) for k in configs}
    out = layer(inputs)
    x = keras.layers.Concatenate()([out[k] for k in configs])
    for width in (256, 128):
        x = keras.layers.Dense(width, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(x))
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="binary_crossentropy")
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--vocab", type=int, default=100_000, help="ids per feature")
    p.add_argument("--rounds", type=int, help="rounds of windows (default 5, quick 3)")
    args = p.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    batches = 4 if args.quick else 8
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import keras_rs

    import elastic_emb as ee

    rng = np.random.default_rng(0)
    n = c.BATCH_SIZE * batches
    x = {
        f"f{i}": (rng.zipf(1.1, (n, IDS_PER_EXAMPLE)) % args.vocab).astype(np.int64)
        for i in range(FEATURES)
    }
    y = rng.integers(0, 2, (n, 1)).astype(np.float32)
    models = {kind: build(kind, args.vocab, keras_rs, keras, ee) for kind in ("ee", "keras_rs")}
    for model in models.values():  # warm-up: tracing
        model.fit(x, y, batch_size=c.BATCH_SIZE, epochs=1, verbose=0)
    rates: dict[str, list[float]] = {kind: [] for kind in models}
    for _ in range(rounds):
        for kind, model in models.items():
            t0 = time.perf_counter()
            model.fit(x, y, batch_size=c.BATCH_SIZE, epochs=1, verbose=0)
            rates[kind].append(n / (time.perf_counter() - t0))
    ratio = statistics.median(a / b for a, b in zip(rates["ee"], rates["keras_rs"], strict=True))
    print(f"`{c.command_line()}`")
    print(f"keras {keras.__version__}, keras-rs {keras_rs.__version__}; {rounds} rounds of "
          f"{batches} batches per variant, interleaved")  # fmt: skip
    print()
    print(
        c.markdown_table(
            ["workload", "ee.DistributedEmbedding ex/s", "keras-rs ex/s", "ratio", "machine"],
            [
                [
                    f"{FEATURES} features × {IDS_PER_EXAMPLE} Zipf ids, {args.vocab:,} ids each, "
                    f"dim {DIM}, Adagrad, MLP 256-128-1, batch {c.BATCH_SIZE}",
                    c.fmt_rate(statistics.median(rates["ee"])),
                    c.fmt_rate(statistics.median(rates["keras_rs"])),
                    c.fmt_ratio(ratio),
                    c.machine(),
                ]
            ],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
