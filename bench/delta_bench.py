"""Deltas to serving (issue 13): bytes and time of a delta against a full export.

A model with one `ee.Embedding` table of `--rows` rows (dim `--dim`,
Adagrad) and a Dense 64-1 head is exported in full (version 1). Then a
fraction `--changed` of its rows changes: 90 % of those are existing rows
pushed a gradient, 10 % new ids pushed (inserted), and 0.1 % of the rows
are erased; the Dense kernel changes too. Side by side, interleaved
`--repeats` times, medians reported:

- the full export of that state (`ee.export_saved_model`, the reference);
- `ee.export_delta(since=version 1)` (what the trainer writes instead);
- `ee.apply_delta(version 1, delta)` (what a serving host runs to get the
  next version directory).

Every applied version is checked to hold exactly the full export's tensors.
Prints a Markdown table.

    python bench/delta_bench.py [--rows 1000000] [--dim 16] [--changed 0.01] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import _common as c


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _timed(run: object) -> tuple[float, float]:
    """(wall, CPU) seconds of `run()`."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()  # type: ignore[operator]
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import keras
    import numpy as np

    import elastic_emb as ee
    from elastic_emb.serving import export as serving

    rng = np.random.default_rng(0)
    ids = keras.Input((), dtype="int64", name="ids")
    embedded = ee.Embedding(args.dim, name="delta_bench", optimizer="adagrad")(ids)
    head = keras.layers.Dense(1)(keras.layers.Dense(64, activation="relu")(embedded))
    model = keras.Model({"ids": ids}, head)
    model.predict({"ids": np.arange(4)}, verbose=0)
    table = model.get_layer("delta_bench").table
    keys = rng.choice(2**62, args.rows, replace=False).astype(np.int64)
    table.import_rows(keys, rng.normal(0, 0.05, (args.rows, args.dim)).astype(np.float32))

    root = Path(tempfile.mkdtemp(prefix="delta_bench_"))
    base = root / "model" / "1"
    ee.export_saved_model(model, base)

    changed = int(args.rows * args.changed)
    pushed = np.concatenate([
        rng.choice(keys, changed - changed // 10, replace=False),
        rng.choice(2**62, changed // 10).astype(np.int64) | (1 << 62),  # new ids
    ])  # fmt: skip
    table.push(pushed, rng.normal(0, 0.1, (len(pushed), args.dim)).astype(np.float32))
    table.erase(rng.choice(np.setdiff1d(keys, pushed), args.rows // 1000, replace=False))
    kernel = model.layers[-1].kernel
    kernel.assign(kernel.numpy() + 0.01)

    times: dict[str, list[tuple[float, float]]] = {"full": [], "delta": [], "apply": []}
    for i in range(args.repeats):
        full, delta, applied = root / f"full-{i}", root / f"delta-{i}", root / f"applied-{i}"
        times["full"].append(_timed(lambda: ee.export_saved_model(model, full)))  # noqa: B023
        times["delta"].append(_timed(lambda: ee.export_delta(model, delta, since=base)))  # noqa: B023
        times["apply"].append(_timed(lambda: ee.apply_delta(base, delta, applied)))  # noqa: B023
        got, want = serving.saved_state(applied), serving.saved_state(full)
        if (
            any(got[name].tobytes() != want[name].tobytes() for name in want)
            or got.keys() != want.keys()
        ):
            raise SystemExit("the applied version differs from the full export")
    full_bytes, delta_bytes = _size(root / "full-0"), _size(root / "delta-0")

    def cell(what: str) -> str:
        wall = statistics.median(t[0] for t in times[what])
        cpu = statistics.median(t[1] for t in times[what])
        return f"{wall:.2f} s wall, {cpu:.2f} s CPU"

    full_wall = statistics.median(t[0] for t in times["full"])
    print(f"Workload: {args.rows:,} rows × dim {args.dim} (float32), Dense 64-1; "
          f"{args.changed:.1%} of rows changed (90 % pushed, 10 % new), 0.1 % erased; "
          f"medians of {args.repeats}. Machine: {c.machine()}.\n")  # fmt: skip
    print(
        c.markdown_table(
            ["", "bytes", "time", "vs full export"],
            [
                ["full export (reference)", f"{full_bytes:,}", cell("full"), "1"],
                [
                    "ee.export_delta",
                    f"{delta_bytes:,} ({delta_bytes / full_bytes:.2%})",
                    cell("delta"),
                    f"{statistics.median(t[0] for t in times['delta']) / full_wall:.2f}×",
                ],
                [
                    "ee.apply_delta (next version)",
                    f"{_size(root / 'applied-0'):,}",
                    cell("apply"),
                    f"{statistics.median(t[0] for t in times['apply']) / full_wall:.2f}×",
                ],
            ],
        )
    )
    print(f"\n{c.command_line()}")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
