"""What bounding a table's rows costs in model quality (issue 12), side by side in one run.

The demo's DLRM-style model (26 `ee.Embedding` tables, dim 16, Adagrad) on
generated Criteo-format data with a planted signal (Zipf-distributed ids:
a long tail). Two parts, each a Markdown table:

- **formats**: the model trained once; for each row format of
  `ee.export_rows` (float32, float16, bfloat16, int8 with a float32 scale
  and bias per row), its rows go through that format and back and the same
  model's test AUC is measured, side by side with float32. This is what a
  SavedModel exported with `ee.export_saved_model(..., row_dtype=...)`
  predicts (tests/test_export.py checks that the two agree).
- **policies**: the model trained from the same seed and data once per
  policy (none, float16 and bfloat16 row storage, admission, LFU/LRU at
  half the unbounded table's rows per table, TTL, all together): rows
  kept, table bytes per row, training
  examples/s (wall and CPU) and test AUC against the unbounded table.
  Memory is the tables' own (`memory_bytes`: index, row arena, free list,
  admission sketch), not the process's, which TensorFlow dominates.

    python bench/storage_bench.py [--examples 200000] [--epochs 1] [--part formats|policies]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import _common as c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--test-examples", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--part", choices=("formats", "policies", "all"), default="all")
    args = parser.parse_args()

    train, test, info = c.train_and_test(args.examples, args.test_examples, args.seed)
    setting = (
        f"{args.examples:,} training and {args.test_examples:,} test examples, {args.epochs} "
        f"epoch(s), 26 tables of dim 16; best reachable AUC {info['oracle_auc']:.4f}; "
        f"{c.machine()}"
    )
    print(f"\n`{c.command_line()}`: {setting}")
    if args.part in ("formats", "all"):
        formats(args, train, test)
    if args.part in ("policies", "all"):
        policies(args, train, test)


def formats(args: argparse.Namespace, train: Any, test: Any) -> None:
    import keras

    import elastic_emb as ee
    from elastic_emb.examples import criteo as data
    from elastic_emb.examples.dlrm import build_dlrm
    from elastic_emb.tables.rows import ROW_DTYPES

    keras.utils.set_random_seed(args.seed)
    layers: list[ee.Embedding] = []

    def embedding(i: int) -> ee.Embedding:
        layers.append(ee.Embedding(16, ee.optimizers.Adagrad(0.05), name=f"C{i + 1}"))
        return layers[-1]

    model = build_dlrm(embedding, seed=args.seed)
    model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
    t0 = time.perf_counter()
    model.fit(*train, batch_size=4096, epochs=args.epochs, verbose=0)
    print(f"trained in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    trained = [(layer.table, layer.table.export_rows()) for layer in layers]
    num_rows = sum(len(keys) for _, (keys, _) in trained)

    rows = []
    base_auc = None
    for dtype in ROW_DTYPES:
        for table, (keys, values) in trained:  # the trained rows, through `dtype` and back
            compact = ee.export_rows(table, dtype) if dtype != "float32" else None
            table.import_rows(keys, values if compact is None else compact.dequantize())
        scores = model.predict(test[0], batch_size=8192, verbose=0)[:, 0]
        test_auc = data.auc(test[1], scores)
        base_auc = test_auc if base_auc is None else base_auc
        per_row = ee.export_rows(trained[0][0], dtype).bytes_per_row
        rows.append(
            [
                dtype,
                f"{per_row}",
                f"{per_row / (16 * 4):.3f}×",
                f"{test_auc:.5f}",
                f"{test_auc - base_auc:+.5f}",
            ]
        )
        for table, (keys, values) in trained:  # back to the trained float32 rows
            table.import_rows(keys, values)
    print(f"\n### Row formats ({num_rows:,} rows)\n")
    print(
        c.markdown_table(
            ["row format", "bytes/row (values)", "× float32", "test AUC", "Δ AUC vs float32"],
            rows,
        )
    )


def policies(args: argparse.Namespace, train: Any, test: Any) -> None:
    import keras

    import elastic_emb as ee
    from elastic_emb.examples import criteo as data
    from elastic_emb.examples.dlrm import build_dlrm

    def run(per_table: Callable[[int], dict[str, Any]]) -> dict[str, float]:
        """Trains a fresh model whose table i gets `per_table(i)`; its figures."""
        keras.utils.set_random_seed(args.seed)
        layers: list[ee.Embedding] = []

        def embedding(i: int) -> ee.Embedding:
            opt = ee.optimizers.Adagrad(0.05)
            layers.append(ee.Embedding(16, opt, name=f"C{i + 1}", **per_table(i)))
            return layers[-1]

        model = build_dlrm(embedding, seed=args.seed)
        model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
        wall, cpu = time.perf_counter(), time.process_time()
        model.fit(*train, batch_size=4096, epochs=args.epochs, verbose=0)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        scores = model.predict(test[0], batch_size=8192, verbose=0)[:, 0]
        examples = len(train[1]) * args.epochs
        states = [layer.table.export_state() for layer in layers]
        return {
            "rows": sum(len(layer.table) for layer in layers),
            "per_table": [len(layer.table) for layer in layers],  # type: ignore[dict-item]
            "bytes": sum(layer.table.memory_bytes() for layer in layers),
            "sketch": sum(0 if s.counts is None else len(s.counts) for s in states),
            "wall": examples / wall,
            "cpu": examples / cpu,
            "auc": data.auc(test[1], scores),
            "evicted": sum(layer.table.policy_counts()["evicted_rows"] for layer in layers),
        }

    base = run(lambda i: {})
    half = [max(1, n // 2) for n in base["per_table"]]  # type: ignore[union-attr]
    admit = ee.admission.Frequency(min_count=2)
    steps_per_epoch = -(-len(train[1]) // 4096)
    ttl = max(1, steps_per_epoch // 4)
    variants: list[tuple[str, Callable[[int], dict[str, Any]]]] = [
        ("float16 rows", lambda i: {"row_dtype": "float16"}),
        ("bfloat16 rows", lambda i: {"row_dtype": "bfloat16"}),
        ("admission min_count=2", lambda i: {"admission": admit}),
        ("LFU at ½ the rows", lambda i: {"eviction": ee.eviction.LFU(half[i])}),
        ("LRU at ½ the rows", lambda i: {"eviction": ee.eviction.LRU(half[i])}),
        (f"TTL {ttl} steps", lambda i: {"eviction": ee.eviction.TTL(ttl)}),
        (
            "admission + LFU at ½, float16 rows",
            lambda i: {
                "admission": admit,
                "eviction": ee.eviction.LFU(half[i]),
                "row_dtype": "float16",
            },
        ),
    ]
    results = [("unbounded", base)] + [(name, run(f)) for name, f in variants]
    rows = []
    for name, r in results:
        rows.append(
            [
                name,
                f"{int(r['rows']):,}",
                f"{r['rows'] / base['rows']:.2f}",
                f"{int(r['evicted']):,}",
                f"{(r['bytes'] - r['sketch']) / max(r['rows'], 1):.0f}",
                f"{r['sketch'] / 2**20:.0f}",
                f"{r['bytes'] / 2**20:.1f}",
                f"{r['wall']:,.0f}",
                f"{r['cpu']:,.0f}",
                f"{r['auc']:.5f}",
                f"{r['auc'] - base['auc']:+.5f}",
            ]
        )
    print(f"\n### Admission and eviction ({steps_per_epoch} steps per epoch, batch 4096)\n")
    headers = ["policy", "rows kept", "× unbounded", "evicted", "bytes/row (index, rows)"]
    headers += ["sketch MiB", "tables MiB (all)"]
    headers += ["examples/s (wall)", "examples/s (CPU)", "test AUC", "Δ AUC"]
    print(c.markdown_table(headers, rows))


if __name__ == "__main__":
    main()
