"""What `ee.Embedding` costs per training step over the dense network alone (issue 11).

The model: 26 categorical features (Zipf ids, 100,000 per feature, dim 16)
and 13 dense ones, concatenated into the MLP 512-256-1, trained with
`model.fit` (Adagrad). Variants, each in its own process, taking turns
window by window:

- `ceiling`: the embeddings are a gather from a small frozen matrix (no
  table, no optimizer, no transfer): the issue's dense-only ceiling.
- `gradient ceiling`: the same, times one trainable scalar. The backward
  pass then computes the gradient of the loss with respect to the embedding
  outputs (a `(batch, 416) x (416, 512)` matmul the ceiling skips), which
  every trained embedding needs: the least any trainable embedding costs.
- `stock trainable`: stock `keras.layers.Embedding` layers over a trainable
  1000-row matrix each (no growth, a dense Adagrad update of 16,000 values
  per table): what 26 trained embedding branches cost TensorFlow and Keras
  with next to no table work.
- `ee in-process`: `ee.Embedding` tables in the training process.
- `ee 2 PS sync`: the same tables on 2 `elastic-emb serve` shards on
  127.0.0.1 (`ee.init(ps=..., mode="sync")`), sharing the machine's cores.
- `... (per layer)`: the same, each layer looking up on its own (one
  `numpy_function` per layer and direction) instead of the model's one
  fused lookup: what the fusion across layers gains.
- `ee 2 PS sync (lookahead)`: the dataset wrapped by `ee.lookahead`, which
  reads each step's rows while the step before ends.
- `ee 2 PS sync (gRPC plane)`: `ee 2 PS sync` with Pull and Push through
  gRPC (`ee.init(data_plane="grpc")`) instead of the servers' data plane.

Every variant reads the same `tf.data` pipeline (in-memory batches,
repeated); each window is one `model.fit` epoch of `--steps` steps.

Cases: batch 4096 and 512, and 26 tables (one layer per feature) against 1
table (one layer looks up all 26 features, ids offset per feature). Figures
are median step times; ratios are medians over rounds of each variant's step
time over the ceiling's in the same round (wall time), and the same with CPU
time (all processes of the variant, PS shards included). On a shared virtual
machine the wall times are not to be trusted alone: some windows of every
variant stretch to the same ~134 ms a step whatever their work, so the
targets are judged on CPU time. Prints a Markdown table.

    python bench/step_overhead.py [--rounds 5] [--steps 20] [--cases 4096x26,512x26,...]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import _common as c
import numpy as np
from remote_bench import Child, children, cpu_seconds, log, ps_shards

VOCAB, DIM, FROZEN_ROWS, NUM_FEATURES, NUM_DENSE = 100_000, 16, 1000, 26, 13
VARIANTS = (
    "ceiling",
    "gradient ceiling",
    "stock trainable",
    "ee in-process",
    "ee in-process (per layer)",
    "ee 2 PS sync",
    "ee 2 PS sync (per layer)",
    "ee 2 PS sync (lookahead)",
    "ee 2 PS sync (gRPC plane)",
)
PER_LAYER = " (per layer)"
GRPC_PLANE = " (gRPC plane)"  # ee.init(data_plane="grpc"): Pull and Push through gRPC
TARGETS = {"ee in-process": 1.15, "ee 2 PS sync": 1.35}  # x the ceiling, from issue 11


def parse_case(text: str) -> tuple[int, int]:
    """ "4096x26" -> (batch 4096, 26 tables)."""
    batch, tables = text.split("x")
    if int(tables) not in (1, NUM_FEATURES):
        raise SystemExit(f"tables must be 1 or {NUM_FEATURES}. Received: {text}")
    return int(batch), int(tables)


def make_data(batch: int, steps: int, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    n = batch * steps
    ids = [np.minimum(rng.zipf(1.2, (n, 1)) - 1, VOCAB - 1) for _ in range(NUM_FEATURES)]
    dense = rng.normal(size=(n, NUM_DENSE)).astype(np.float32)
    return [*ids, dense], rng.integers(0, 2, (n, 1)).astype(np.float32)


def build(variant: str, tables: int) -> Any:
    """The compiled model of `variant` with 1 or 26 tables."""
    import keras

    import elastic_emb as ee

    class Scale(keras.layers.Layer):
        """x times a trainable scalar (1.0): makes the backward pass reach x."""

        def build(self, shape: Any) -> None:
            self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

        def call(self, x: Any) -> Any:
            return x * self.scale

    ids = [keras.Input((1,), dtype="int64") for _ in range(NUM_FEATURES)]
    dense = keras.Input((NUM_DENSE,))

    def embed(name: str, keys: Any) -> Any:
        if variant.startswith("ee"):
            layer = ee.Embedding(DIM, ee.optimizers.Adagrad(0.05), name=name)
        else:
            trainable = variant == "stock trainable"
            layer = keras.layers.Embedding(FROZEN_ROWS, DIM, name=name, trainable=trainable)
            keys = keras.ops.mod(keys, FROZEN_ROWS)
        return keras.layers.Flatten()(layer(keys))

    if tables == 1:  # one lookup of every feature's ids, offset to keep them apart
        features = [
            embed("shared", keras.layers.Concatenate()([x + i * VOCAB for i, x in enumerate(ids)]))
        ]
    else:
        features = [embed(f"e{i}", x) for i, x in enumerate(ids)]
    h = keras.layers.Concatenate()(features)
    if variant == "gradient ceiling":
        h = Scale()(h)
    h = keras.layers.Concatenate()([h, dense])
    for units in (512, 256):
        h = keras.layers.Dense(units, activation="relu")(h)
    model = keras.Model([*ids, dense], keras.layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="binary_crossentropy")
    return model


def variant_worker(conn: Any, variant: str, ps: list[str] | None, cases: list, steps: int) -> None:
    """Child: one model per case; each message `(case, steps)` trains one window of it.

    Reply: (wall seconds per step, CPU seconds per step of this process).
    """
    import elastic_emb as ee

    if variant.endswith(PER_LAYER):  # no model is fused: every layer looks up alone
        from elastic_emb.keras import lookup

        lookup._plan = lambda model, layer_type: None
    if ps:
        ee.init(ps=ps, mode="sync", data_plane="grpc" if variant.endswith(GRPC_PLANE) else "native")
    import tensorflow as tf

    models = {case: build(variant, case[1]) for case in cases}
    data = {}
    for case in cases:
        x, y = make_data(case[0], steps)
        data[case] = tf.data.Dataset.from_tensor_slices((tuple(x), y)).batch(case[0]).repeat()
        if variant.endswith("(lookahead)"):
            data[case] = ee.lookahead(data[case], models[case])
    conn.send(("ready", None))
    while (msg := conn.recv()) is not None:
        case, n = msg
        wall, cpu = time.perf_counter(), time.process_time()
        models[case].fit(data[case], epochs=1, steps_per_epoch=n, shuffle=False, verbose=0)
        conn.send(("window", ((time.perf_counter() - wall) / n, (time.process_time() - cpu) / n)))
    if ps:
        ee.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="batches per window")
    parser.add_argument("--cases", default="4096x26,4096x1,512x26,512x1", help="BATCHxTABLES,...")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    cases = [parse_case(t) for t in args.cases.split(",")]
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants: choose from {VARIANTS}")
    ctx = multiprocessing.get_context("spawn")
    remote = [v for v in variants if "PS" in v]  # each its own 2 shards
    with ps_shards(2 * len(remote)) as shards:
        own = {v: shards[2 * i : 2 * i + 2] for i, v in enumerate(remote)}
        pids = {v: [s.process.pid for s in own[v]] for v in remote}

        def make() -> dict[str, Child]:
            return {
                v: Child(
                    ctx,
                    v,
                    variant_worker,
                    v,
                    [s.address for s in own[v]] if v in own else None,
                    cases,
                    args.steps,
                )
                for v in variants
            }

        with children(make) as workers:
            for w in workers.values():
                w.recv()
            log(f"{len(workers)} variants ready")

            def window(v: str, case: tuple[int, int], steps: int) -> tuple[float, float]:
                servers = pids.get(v, [])
                before = sum(cpu_seconds(p) for p in servers)
                wall, cpu = workers[v].request((case, steps))
                return wall, cpu + (sum(cpu_seconds(p) for p in servers) - before) / steps

            rows = []
            for case in cases:
                for v in variants:
                    window(v, case, 3)  # trace and warm up
                times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
                for r in range(args.rounds):
                    for v in variants if r % 2 == 0 else variants[::-1]:
                        times[v].append(window(v, case, args.steps))
                    log(
                        f"batch {case[0]}, {case[1]} tables, round {r + 1}: "
                        + ", ".join(f"{v} {1e3 * times[v][-1][0]:.0f} ms" for v in variants)
                    )
                rows += case_rows(case, variants, times)
    print(f"\n`{c.command_line()}`; {args.rounds} rounds of {args.steps} steps per variant\n")
    print(
        c.markdown_table(
            [
                "batch",
                "tables",
                "variant",
                "ms/step (wall)",
                "× ceiling (wall)",
                "× ceiling (CPU)",
                "× gradient ceiling (CPU)",
                "× stock trainable (CPU)",
                "target (on CPU)",
                "machine",
            ],
            rows,
        )
    )


def case_rows(case: tuple[int, int], variants: list[str], times: dict) -> list[list[str]]:
    """Table rows of one case: medians of per-round ratios to the two ceilings."""

    def ratio(v: str, base: str, kind: int) -> str:
        if base not in times:
            return "-"
        return c.fmt_ratio(
            statistics.median(a[kind] / b[kind] for a, b in zip(times[v], times[base], strict=True))
        )

    rows = []
    for v in variants:
        target = TARGETS.get(v)
        met = ""
        if target is not None and "ceiling" in times:
            value = statistics.median(
                a[1] / b[1] for a, b in zip(times[v], times["ceiling"], strict=True)
            )
            met = f"≤ {target}× ({'met' if value <= target else 'missed'})"
        rows.append(
            [
                case[0],
                case[1],
                v,
                f"{1e3 * statistics.median(t[0] for t in times[v]):.1f}",
                ratio(v, "ceiling", 0),
                ratio(v, "ceiling", 1),
                ratio(v, "gradient ceiling", 1),
                ratio(v, "stock trainable", 1),
                met,
                c.machine(),
            ]
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
