"""What compact row formats cost in model quality (issue 12): bytes per row and test AUC.

Trains the demo's DLRM-style model (26 `ee.Embedding` tables, dim 16,
Adagrad) on generated Criteo-format data with a planted signal, then, for
each row format of `ee.export_rows` (float32, float16, bfloat16, int8 with a
float32 scale and bias per row), puts the tables' rows through that format
and back and measures the test AUC of the same model, side by side with
float32. This is what a SavedModel exported with
`ee.export_saved_model(..., row_dtype=...)` predicts (tests/test_export.py
checks that the two agree). Prints a Markdown table.

    python bench/storage_bench.py [--examples 200000] [--epochs 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import _common as c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--test-examples", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import keras

    import elastic_emb as ee
    from elastic_emb.examples import criteo as data
    from elastic_emb.examples.dlrm import build_dlrm
    from elastic_emb.rows import ROW_DTYPES

    keras.utils.set_random_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        info = data.generate_criteo(Path(tmp) / "train.tsv", args.examples, seed=args.seed)
        data.generate_criteo(
            Path(tmp) / "test.tsv", args.test_examples, seed=args.seed, sample_seed=args.seed + 1
        )
        train_arrays = data.read_criteo(Path(tmp) / "train.tsv")
        test_arrays = data.read_criteo(Path(tmp) / "test.tsv")
    train = data.model_inputs(*train_arrays[:2]), train_arrays[2]
    test = data.model_inputs(*test_arrays[:2]), test_arrays[2]

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
    print(
        f"\n`{c.command_line()}`: {args.examples:,} training and {args.test_examples:,} test "
        f"examples, {args.epochs} epoch(s), {num_rows:,} rows in 26 tables of dim 16; best "
        f"reachable AUC {info['oracle_auc']:.4f}; {c.machine()}\n"
    )
    print(
        c.markdown_table(
            ["row format", "bytes/row (values)", "× float32", "test AUC", "Δ AUC vs float32"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
