"""The 26-table DLRM step on Keras' JAX backend: `ee.Embedding` against stock
`keras.layers.Embedding` with the full vocabulary, and against the TensorFlow backend.

The model is BENCH.md's end-to-end DLRM (`build_keras3_dlrm`: 13 dense and 26
categorical features, dim 16, MLP 512-256-1, Adagrad for the dense weights and the
tables), trained with `model.fit` on in-memory NumPy batches. Ids: Zipf(1.1) ranks
over `--vocab` ids per feature, the same ids for every variant (the stock layers
need them below their `input_dim`). Variants, each in its own process, taking turns
window by window (`_common.interleave` over pipes):

- `jax stock`: `keras.layers.Embedding(vocab, 16)` per feature, on JAX (its jitted
  step updates every row of every table: Keras's Adagrad is dense);
- `jax ee`: `ee.Embedding` tables in the process, on JAX (host callbacks in the
  jitted step; the tables' Adagrad touches the batch's rows only);
- `jax floor`: layers that output zeros: the dense network alone, the ceiling;
- `tf ee`: `ee.Embedding` on the TensorFlow backend (`--tf-python`, a Python with
  TensorFlow and elastic_emb), the same model and ids;
- `jax ee (baseline)`: `jax ee` with elastic_emb from another checkout
  (`--baseline-src DIR`), to measure a change side by side.

Figures are medians over rounds; ratios (to `jax stock`, and to `tf ee` where it runs)
are medians of per-round ratios, on wall time and on CPU time (each variant is one
process). Where the stock table does not
fit (26 × vocab × 16 floats and Adagrad's as many), `--huge-ids` runs `jax ee` alone
on ids spread over 2**40 to show it keeps working. Prints a Markdown table.

    python bench/jax_bench.py [--jax-python P] [--tf-python P] [--batches 4096,512]
        [--rounds 5] [--steps 10] [--vocab 100000] [--baseline-src DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import _common as c
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def make_ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """Zipf(1.1) ranks below `vocab`, a different permutation of ids per feature."""
    ranks = (rng.zipf(1.1, size=(n, c.NUM_CATEGORICAL)) - 1) % vocab
    shuffles = np.stack([rng.permutation(vocab) for _ in range(c.NUM_CATEGORICAL)])
    return shuffles[np.arange(c.NUM_CATEGORICAL), ranks].astype(np.int64)


# The child: one variant, one process.


def child(variant: str, batch: int, vocab: int, huge_ids: bool) -> None:
    import keras

    kind = {"stock": "keras", "ee": "ee", "floor": "floor"}[variant]
    rng = np.random.default_rng(0)
    windows_of_data = 8
    n = batch * windows_of_data * 4
    ids = make_ids(rng, n, vocab)
    if huge_ids:  # spread over 2**40: no dense table could hold them
        ids = ids * 10_995_116 + np.arange(c.NUM_CATEGORICAL)
    x = {
        "dense": rng.normal(size=(n, c.NUM_DENSE)).astype(np.float32),
        "categorical": ids,
    }
    y = rng.integers(0, 2, (n, 1)).astype(np.float32)
    model = c.build_keras3_dlrm(kind, "adagrad", [vocab] * c.NUM_CATEGORICAL)
    timer_cls = c.make_timer(keras)
    position = 0
    for line in sys.stdin:
        steps = int(line)
        start = position * batch
        if start + steps * batch > n:
            position, start = 0, 0
        end = start + steps * batch
        position += steps
        timer = timer_cls()
        model.fit(
            {k: v[start:end] for k, v in x.items()},
            y[start:end],
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[timer],
        )
        examples = (len(timer.times) - 1) * batch
        window = {
            "examples_per_s": examples / (timer.times[-1] - timer.times[0]),
            "loss": timer.loss,
            "examples_per_cpu_s": examples / (timer.cpu_times[-1] - timer.cpu_times[0]),
        }
        print(json.dumps(window), flush=True)


# The parent.


class Variant:
    """A child process training one variant, a window per request."""

    def __init__(
        self, python: str, backend: str, variant: str, args: Any, batch: int, source: str = ""
    ) -> None:
        env = {
            **os.environ,
            "KERAS_BACKEND": backend,
            "JAX_ENABLE_X64": "1",
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONPATH": os.pathsep.join(
                p for p in (HERE, source, os.environ.get("PYTHONPATH")) if p
            ),
        }
        command = [python, os.path.abspath(__file__), "--child", variant, "--batch", str(batch)]
        command += ["--vocab", str(args.vocab)] + (["--huge-ids"] if args.huge_ids else [])
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def __call__(self, steps: int) -> c.Window:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{steps}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a variant exited (code {self.process.wait()})")
        w = json.loads(line)
        return c.Window(w["examples_per_s"], w["loss"], w["examples_per_cpu_s"])

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(120)


def paired_cpu_ratio(a: c.Result, b: c.Result) -> float:
    return statistics.median(
        x.examples_per_cpu_s / y.examples_per_cpu_s
        for x, y in zip(a.windows, b.windows, strict=True)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=4096, help=argparse.SUPPRESS)
    p.add_argument("--jax-python", default=sys.executable, help="a Python with JAX (default: this)")
    p.add_argument("--tf-python", help="a Python with TensorFlow: adds the `tf ee` variant")
    p.add_argument("--batches", default="4096,512", help="batch sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="batches per timed window")
    p.add_argument("--vocab", type=int, default=100_000, help="ids per feature")
    p.add_argument("--huge-ids", action="store_true", help="jax ee alone, ids over 2**40")
    p.add_argument(
        "--baseline-src",
        help="a checkout of elastic_emb (its built package importable): adds `jax ee "
        "(baseline)`, the same variant with elastic_emb imported from there",
    )
    args = p.parse_args()
    if args.child:
        child(args.child, args.batch, args.vocab, args.huge_ids)
        return

    variants = {"jax stock": "jax stock", "jax ee": "jax ee", "jax floor": "jax floor"}
    if args.baseline_src:
        variants["jax ee (baseline)"] = "jax ee"
    if args.huge_ids:
        variants = {"jax ee (ids over 2**40)": "jax ee"}
    elif args.tf_python:
        variants["tf ee"] = "tensorflow ee"
    print(f"{c.command_line()}\n\n{c.machine()}\n")
    for batch in (int(b) for b in args.batches.split(",")):
        runners: dict[str, Variant] = {}
        try:
            for name, spec in variants.items():
                backend, variant = spec.split()
                backend = "tensorflow" if backend.startswith("t") else "jax"
                python = args.tf_python if backend == "tensorflow" else args.jax_python
                source = args.baseline_src if name.endswith("(baseline)") else ""
                runners[name] = Variant(python, backend, variant, args, batch, source)
            results = c.interleave(
                runners,
                steps=args.steps,
                rounds=args.rounds,
                warmup_steps=3,
                log=lambda s: print(s, file=sys.stderr, flush=True),
            )
        finally:
            for runner in runners.values():
                runner.close()
        reference = results.get("jax stock")
        tf_ee = results.get("tf ee")
        rows = []
        for name, r in results.items():
            ratios = ["", ""]
            if reference is not None and r is not reference:
                ratios = [
                    c.fmt_ratio(c.paired_ratio(r, reference)),
                    c.fmt_ratio(paired_cpu_ratio(r, reference)),
                ]
            if tf_ee is not None:
                ratios += (
                    ["", ""]
                    if r is tf_ee
                    else [
                        c.fmt_ratio(c.paired_ratio(r, tf_ee)),
                        c.fmt_ratio(paired_cpu_ratio(r, tf_ee)),
                    ]
                )
            rows.append(
                [name, batch, c.fmt_rate(r.examples_per_s), c.fmt_rate(r.examples_per_cpu_s),
                 *ratios, f"{100 * r.spread:.0f}%", f"{r.loss:.4f}"]
            )  # fmt: skip
        headers = ["variant", "batch", "ex/s", "ex per CPU-s"]
        headers += ["vs jax stock (wall)", "vs jax stock (CPU)"]
        if tf_ee is not None:
            headers += ["vs tf ee (wall)", "vs tf ee (CPU)"]
        print(c.markdown_table([*headers, "spread", "loss"], rows))
        print()


if __name__ == "__main__":
    main()
