"""End-to-end CTR training throughput: `ee.Embedding` vs `keras.layers.Embedding`.

The DLRM-style model of `elastic_emb.examples.dlrm.build_dlrm` (13 dense + 26
categorical Criteo features, embedding dim 16, top MLP 512-256-1, batch 4096)
is trained with `model.fit` on generated Criteo data with Adagrad and with SGD,
in three variants: `ee.Embedding` layers, stock `keras.layers.Embedding`
layers sized to the vocabulary, and zero-output layers (the dense network
alone: the ceiling of any embedding layer). All variants live in this one
process and take turns window by window; each figure is the median
examples/s of its windows, each ratio the median of per-round ratios. The
run is repeated for each vocabulary of `--vocab` (the stock layers' cost grows
with it; elastic_emb's does not). Prints Markdown tables.

Usage:
    python bench/e2e.py --quick                 # a few minutes
    python bench/e2e.py                         # the full run
    python bench/e2e.py --vocab default --variants keras,floor
"""

from __future__ import annotations

import argparse

import _common as c

# Targets of the issue, printed next to the ratios (not asserted).
TARGETS = {"adagrad": 4.0, "sgd": 2.0}
VARIANT_NAMES = {"ee": "elastic_emb", "keras": "keras", "floor": "no-embedding"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    c.add_run_args(p)
    p.add_argument(
        "--vocab",
        default="default,1000000",
        help="comma-separated vocabularies to sweep, each " + c.VOCAB_HELP,
    )
    p.add_argument("--optimizers", default="adagrad,sgd", help="comma-separated: adagrad,sgd")
    p.add_argument(
        "--variants",
        default="ee,keras,floor",
        help="comma-separated: ee (ee.Embedding), keras (keras.layers.Embedding), floor (the\n"
        "same model with zero-output embedding layers: the dense network's own cost)",
    )
    p.add_argument(
        "--jit-compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="model.compile(jit_compile=...) (auto: what Keras picks)",
    )
    return c.finish_run_args(p.parse_args(argv))


def run_vocab(
    args: argparse.Namespace, vocab_size: int | None
) -> tuple[list[list[str]], dict[str, c.Result], dict[str, str]]:
    """Measures every variant on data with one vocabulary.

    Returns:
        `(rows, results, notes)`: rows of the main table, and the results and
        notes of the details table, by variant name.
    """
    import gc

    import keras
    import tensorflow as tf

    optimizers, variants = args.optimizers.split(","), args.variants.split(",")
    jit = {"auto": "auto", "on": True, "off": False}[args.jit_compile]
    arrays, vocab_sizes = c.prepare_data(args, vocab_size)
    stream = c.BatchStream(tf, arrays, args.batch_size)
    runners: dict[str, c.FitRunner] = {}
    notes: dict[str, str] = {}
    for opt in optimizers:
        for kind in variants:
            name = f"{VARIANT_NAMES[kind]}/{opt}"
            model = c.build_keras3_dlrm(kind, opt, vocab_sizes, jit_compile=jit)
            runners[name] = c.FitRunner(keras, model, stream.fork())
            notes[name] = f"jit_compile={model.jit_compile}"
    results = c.interleave(
        runners, steps=args.steps, rounds=args.rounds, warmup_steps=args.warmup_steps
    )
    del runners, stream, arrays
    gc.collect()  # frees the stock tables before the next vocabulary's

    gpu = bool(tf.config.list_physical_devices("GPU"))

    def rate(name: str) -> str:
        return c.fmt_rate(results[name].examples_per_s) if name in results else "-"

    rows: list[list[str]] = []
    for opt in optimizers:
        ee_name, ref_name = f"elastic_emb/{opt}", f"keras/{opt}"
        ratio, to_ceiling = "-", "-"
        if ee_name in results and ref_name in results:
            ratio = c.fmt_ratio(c.paired_ratio(results[ee_name], results[ref_name]))
        floor_name = f"no-embedding/{opt}"
        if ee_name in results and floor_name in results:
            # ee's step time over the ceiling's: the ceiling's ex/s over ee's.
            to_ceiling = c.fmt_ratio(c.paired_ratio(results[floor_name], results[ee_name]))
        rows.append(
            [
                c.workload(opt, args.batch_size, vocab_sizes),
                rate(ee_name),
                rate(ref_name),
                ratio,
                f"≥ {TARGETS[opt]:.0f}×",
                rate(floor_name),
                to_ceiling,
                c.machine(gpu),
            ]
        )
    ids = f" ({sum(vocab_sizes):,} ids)"
    return (
        rows,
        {name + ids: r for name, r in results.items()},
        {name + ids: note for name, note in notes.items()},
    )


def main(argv: list[str] | None = None) -> None:
    """Runs the benchmark and prints its tables."""
    args = parse_args(argv)
    optimizers, variants = args.optimizers.split(","), args.variants.split(",")
    if not set(optimizers) <= set(TARGETS) or not set(variants) <= set(VARIANT_NAMES):
        raise SystemExit(
            f"--optimizers: choose from {list(TARGETS)}; "
            f"--variants: choose from {list(VARIANT_NAMES)}"
        )
    vocabs = [c.parse_vocab(v) for v in args.vocab.split(",")]

    import keras
    import tensorflow as tf

    rows: list[list[str]] = []
    results: dict[str, c.Result] = {}
    notes: dict[str, str] = {}
    for vocab_size in vocabs:
        vocab_rows, vocab_results, vocab_notes = run_vocab(args, vocab_size)
        rows += vocab_rows
        results.update(vocab_results)
        notes.update(vocab_notes)

    versions = f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
    if "ee" in variants:
        import elastic_emb

        versions += f", elastic_emb {elastic_emb.__version__}"
    print()
    print(f"`{c.command_line()}`")
    print(
        f"{versions}; "
        f"{args.rounds} windows of {args.steps} batches per variant after {args.warmup_steps} "
        "warm-up batches; ratio: median over rounds of elastic_emb / keras.layers.Embedding "
        "ex/s within the round; "
        "the ceiling is the same model with zero-output embedding layers "
        "(bench/step_overhead.py adds the gradient ceiling, remote tables, batch 512 and one table)"
    )
    print()
    print(
        c.markdown_table(
            [
                "workload",
                "elastic_emb ex/s",
                "keras.layers.Embedding ex/s",
                "ratio",
                "target",
                "no-embedding ceiling ex/s",
                "elastic_emb step time ÷ ceiling's",
                "machine",
            ],
            rows,
        )
    )
    print()
    print(c.details_table(results, notes))


if __name__ == "__main__":
    main()
