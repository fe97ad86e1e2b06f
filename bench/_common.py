"""Shared pieces of the end-to-end training benchmarks (`e2e.py`, `peer_tfra.py`).

Nothing here imports Keras at module level: the same helpers serve Keras 3 and
the legacy `tf_keras` (TFRA's peer process), so the Keras module in use is
passed in where one is needed.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

# The end-to-end workload of BENCH.md.
BATCH_SIZE = 4096
EMBEDDING_DIM = 16
TOP_MLP = (512, 256)
BOTTOM_MLP = (64, 16)  # `elastic_emb.examples.dlrm.build_dlrm`'s default
LEARNING_RATE = 0.05
NUM_DENSE = 13
NUM_CATEGORICAL = 26
OPTIMIZER_NAMES = {"adagrad": "Adagrad", "sgd": "SGD"}

Arrays = dict[str, np.ndarray]  # "dense" float32[N, 13], "categorical" int64[N, 26], "labels"


# ---------------------------------------------------------------------------------------------
# Data


def make_data(
    num_examples: int, *, seed: int = 0, vocab_size: int | None = None
) -> tuple[Arrays, list[int]]:
    """Generates Criteo-format data with `elastic_emb.examples.criteo` and reads it into memory.

    Dense counts become `log1p(max(count, 0))`, the usual Criteo transform, so
    plain SGD stays stable.

    Args:
        num_examples: int, number of examples to generate.
        seed: int, seed of `generate_criteo`.
        vocab_size: int or None, vocabulary size of every categorical feature;
            None keeps `elastic_emb.examples.criteo.DEFAULT_VOCAB_SIZES`.

    Returns:
        `(arrays, vocab_sizes)`: the arrays of `Arrays`, and the 26 vocabulary
        sizes (every id is in `[0, vocab_sizes[f])`).
    """
    from elastic_emb import data as ee_data

    vocab_sizes = None if vocab_size is None else [vocab_size] * NUM_CATEGORICAL
    with tempfile.TemporaryDirectory(prefix="ee-bench-") as tmp:
        path = os.path.join(tmp, "train.tsv")
        info = ee_data.generate_criteo(path, num_examples, seed=seed, vocab_sizes=vocab_sizes)
        dense, categorical, labels = ee_data.read_criteo(path)
    arrays = {
        "dense": ee_data.log_counts(dense).astype(np.float32),
        "categorical": categorical.astype(np.int64),
        "labels": labels.astype(np.float32),
    }
    return arrays, [int(v) for v in info["vocab_sizes"]]


def train_and_test(num_train: int, num_test: int, seed: int) -> tuple[Any, Any, dict[str, Any]]:
    """Planted-signal training and test data for `model.fit` / `model.predict` of the
    demo's DLRM (`criteo.model_inputs`): ((inputs, labels), (inputs, labels), the
    generator's info, e.g. `oracle_auc`); the test examples are other samples of the
    same hidden model."""
    from elastic_emb.examples import criteo

    with tempfile.TemporaryDirectory(prefix="ee-bench-") as tmp:
        train_path, test_path = os.path.join(tmp, "train.tsv"), os.path.join(tmp, "test.tsv")
        info = criteo.generate_criteo(train_path, num_train, seed=seed)
        criteo.generate_criteo(test_path, num_test, seed=seed, sample_seed=seed + 1)
        train = criteo.read_criteo(train_path)
        test = criteo.read_criteo(test_path)
    return (
        (criteo.model_inputs(*train[:2]), train[2]),
        (criteo.model_inputs(*test[:2]), test[2]),
        info,
    )


def parse_vocab(text: str) -> int | None:
    """A `--vocab` value: "default" (None) or the vocabulary size of every feature."""
    if text == "default":
        return None
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = 0
    if value < 2:
        raise SystemExit(f'--vocab: expected "default" or an integer >= 2, got {text!r}')
    return value


def prepare_data(args: argparse.Namespace, vocab_size: int | None) -> tuple[Arrays, list[int]]:
    """`make_data` for the `add_run_args` flags; prints what it made."""
    t0 = time.perf_counter()
    arrays, vocab_sizes = make_data(args.examples, seed=args.seed, vocab_size=vocab_size)
    print(
        f"data: {args.examples:,} examples, {sum(vocab_sizes):,} ids in all vocabularies, "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return arrays, vocab_sizes


def save_data(path: str, arrays: Arrays, vocab_sizes: Sequence[int]) -> None:
    """Writes `make_data`'s result to an `.npz` file (for benchmark subprocesses)."""
    np.savez(path, vocab_sizes=np.asarray(vocab_sizes, np.int64), **arrays)


def load_data(path: str) -> tuple[Arrays, list[int]]:
    """Reads back what `save_data` wrote."""
    with np.load(path) as f:
        arrays = {k: f[k] for k in ("dense", "categorical", "labels")}
        return arrays, [int(v) for v in f["vocab_sizes"]]


class BatchStream:
    """Hands out consecutive windows of whole batches from in-memory arrays.

    Every window starts where the previous one stopped (wrapping around), so a
    model sees fresh batches in each timed window instead of replaying the first
    ones, as it would if each `fit` call restarted the dataset. `fork()` gives
    another model its own position over the same data.
    """

    def __init__(self, tf: ModuleType, arrays: Arrays, batch_size: int):
        num_batches = len(arrays["labels"]) // batch_size
        if num_batches < 1:
            raise ValueError(
                f"Need at least one batch of {batch_size} examples. "
                f"Received: {len(arrays['labels'])} examples"
            )
        n = num_batches * batch_size

        def batched(a: np.ndarray) -> np.ndarray:
            return a[:n].reshape(num_batches, batch_size, *a.shape[1:])

        # One dataset element is one whole batch: no per-example work in tf.data.
        self._dataset = tf.data.Dataset.from_tensor_slices(
            (
                {
                    "dense": batched(arrays["dense"]),
                    "categorical": batched(arrays["categorical"]),
                },
                batched(arrays["labels"]),
            )
        )
        self.batch_size = batch_size
        self.num_batches = num_batches
        self._next = 0

    def fork(self) -> BatchStream:
        """A stream over the same batches, starting again from the first one."""
        other = object.__new__(BatchStream)
        other.__dict__.update(self.__dict__, _next=0)
        return other

    def window(self, steps: int) -> Any:
        """A dataset of the next `steps` batches (repeated, so it never runs dry)."""
        start = self._next
        self._next = (start + steps) % self.num_batches
        return self._dataset.repeat().skip(start).prefetch(2)


# ---------------------------------------------------------------------------------------------
# Keras 3 models


def build_keras3_dlrm(
    kind: str,
    optimizer: str,
    vocab_sizes: Sequence[int],
    *,
    learning_rate: float = LEARNING_RATE,
    jit_compile: bool | str = "auto",
    shared_table: bool = False,
) -> Any:
    """The compiled DLRM of `elastic_emb.examples.dlrm.build_dlrm`, with either embedding layer.

    Args:
        kind: str, `"ee"` for `ee.Embedding` (sparse optimizer in the table),
            `"keras"` for `keras.layers.Embedding(vocab_sizes[i], ...)`, or
            `"floor"` for layers that output zeros: the same dense network with
            no embedding work at all, the ceiling of any embedding layer.
        optimizer: str, `"adagrad"` or `"sgd"`: used for the embeddings and,
            as the Keras optimizer, for the dense weights.
        vocab_sizes: sequence of int, the stock layers' `input_dim`s.
        learning_rate: float, of every optimizer.
        jit_compile: `model.compile`'s argument (Keras's `"auto"` turns XLA
            on for the stock model; `ee.Embedding` opts out of it).
        shared_table: one embedding layer (one table) for all features, their
            ids offset by `shared_offsets(vocab_sizes)`.

    Returns:
        A compiled `keras.Model`.
    """
    import keras

    from elastic_emb.examples.dlrm import build_dlrm

    if optimizer not in ("adagrad", "sgd"):
        raise ValueError(f"`optimizer` must be 'adagrad' or 'sgd'. Received: {optimizer!r}")
    if kind == "ee":
        import elastic_emb as ee

        def factory(i: int) -> Any:
            if optimizer == "adagrad":
                table_opt = ee.optimizers.Adagrad(learning_rate=learning_rate)
            else:
                table_opt = ee.optimizers.SGD(learning_rate=learning_rate)
            # Table names are unique per process: several models live in one process.
            return ee.Embedding(
                output_dim=EMBEDDING_DIM,
                optimizer=table_opt,
                embeddings_initializer="uniform",
                name=f"c{i}_{optimizer}",
            )

    elif kind == "keras":

        def factory(i: int) -> Any:
            rows = sum(vocab_sizes) if shared_table else vocab_sizes[i]
            return keras.layers.Embedding(
                rows, EMBEDDING_DIM, embeddings_initializer="uniform", name=f"c{i}"
            )

    elif kind == "floor":

        class ZeroEmbedding(keras.layers.Layer):
            def call(self, ids: Any) -> Any:
                return keras.ops.zeros((*keras.ops.shape(ids), EMBEDDING_DIM))

        def factory(i: int) -> Any:
            return ZeroEmbedding(name=f"c{i}")

    else:
        raise ValueError(f"`kind` must be 'ee', 'keras' or 'floor'. Received: {kind!r}")
    offsets = shared_offsets(vocab_sizes) if shared_table else None
    model = build_dlrm(factory, bottom_mlp=BOTTOM_MLP, top_mlp=TOP_MLP, feature_offsets=offsets)
    if optimizer == "adagrad":
        dense_opt = keras.optimizers.Adagrad(learning_rate=learning_rate)
    else:
        dense_opt = keras.optimizers.SGD(learning_rate=learning_rate)
    model.compile(optimizer=dense_opt, loss="binary_crossentropy", jit_compile=jit_compile)
    return model


def shared_offsets(vocab_sizes: Sequence[int]) -> list[int]:
    """Offsets that place each feature's ids after the previous features' in one table."""
    return [sum(vocab_sizes[:i]) for i in range(len(vocab_sizes))]


# ---------------------------------------------------------------------------------------------
# Timing


@dataclass
class Window:
    """One timed stretch of training."""

    examples_per_s: float
    loss: float
    examples_per_cpu_s: float = float("nan")  # per second of this process's CPU time


def make_timer(keras_module: ModuleType) -> Any:
    """A `keras_module.callbacks.Callback` that times batches and keeps the last loss.

    The window runs from the end of the first batch to the end of the last one,
    which leaves `fit`'s own start-up (iterator, first-call tracing) outside it.
    """

    class BatchTimer(keras_module.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self.loss = float("nan")

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            self.times.append(time.perf_counter())
            self.cpu_times.append(time.process_time())

        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            self.loss = float((logs or {}).get("loss", float("nan")))

    return BatchTimer


class FitRunner:
    """Trains one compiled model window by window with `model.fit`."""

    def __init__(self, keras_module: ModuleType, model: Any, stream: BatchStream):
        self._timer_cls = make_timer(keras_module)
        self.model = model
        self.stream = stream

    def __call__(self, steps: int) -> Window:
        """Trains `steps` batches; returns examples/s over batches 2..`steps`."""
        if steps < 2:
            raise ValueError(f"`steps` must be at least 2. Received: steps={steps}")
        timer = self._timer_cls()
        self.model.fit(
            self.stream.window(steps),
            epochs=1,
            steps_per_epoch=steps,
            shuffle=False,
            verbose=0,
            callbacks=[timer],
        )
        examples = (len(timer.times) - 1) * self.stream.batch_size
        return Window(
            examples / (timer.times[-1] - timer.times[0]),
            timer.loss,
            examples / (timer.cpu_times[-1] - timer.cpu_times[0]),
        )


@dataclass
class Result:
    """Timed windows of one variant."""

    windows: list[Window] = field(default_factory=list)

    @property
    def examples_per_s(self) -> float:
        """Median examples/s over the timed windows."""
        return statistics.median(w.examples_per_s for w in self.windows)

    @property
    def examples_per_cpu_s(self) -> float:
        """Median examples per second of the process's CPU time (all its threads)."""
        return statistics.median(w.examples_per_cpu_s for w in self.windows)

    @property
    def spread(self) -> float:
        """(max - min) / median of the windows' examples/s: how noisy the figure is."""
        xs = [w.examples_per_s for w in self.windows]
        return (max(xs) - min(xs)) / statistics.median(xs)

    @property
    def loss(self) -> float:
        """The training loss at the end of the last window."""
        return self.windows[-1].loss


def paired_ratio(a: Result, b: Result) -> float:
    """Median over rounds of a's examples/s divided by b's in the same round.

    Rounds pair windows run close together, so a burst of load from other
    processes on a shared machine tends to hit both sides of a pair.
    """
    return statistics.median(
        x.examples_per_s / y.examples_per_s for x, y in zip(a.windows, b.windows, strict=True)
    )


def interleave(
    runners: dict[str, Callable[[int], Window]],
    *,
    steps: int,
    rounds: int,
    warmup_steps: int,
    log: Callable[[str], None] = print,
    unit: str = "ex/s",
) -> dict[str, Result]:
    """Runs every variant `rounds` times, taking turns, after one warm-up window each.

    Every other round runs the variants in reverse order (A B C, C B A, ...),
    so neighbours stay neighbours (for `paired_ratio`) and no variant always
    goes first. The figure of a variant is the median of its rounds. `unit`
    names the rate in `Window.examples_per_s` in the progress lines (a runner
    may time other things than examples, e.g. keys/s); a NaN loss is not shown.
    """
    names = list(runners)
    for name in names:
        t0 = time.perf_counter()
        runners[name](warmup_steps)
        log(f"warm-up {name}: {time.perf_counter() - t0:.1f} s")
    results = {name: Result() for name in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            w = runners[name](steps)
            results[name].windows.append(w)
            loss = "" if math.isnan(w.loss) else f", loss {w.loss:.4f}"
            log(f"round {r + 1}/{rounds} {name}: {w.examples_per_s:,.0f} {unit}{loss}")
    return results


# ---------------------------------------------------------------------------------------------
# Command line


VOCAB_HELP = (
    '"default": elastic_emb.examples.criteo.DEFAULT_VOCAB_SIZES (~1M ids over the 26 features, a\n'
    "scaled-down Criteo), or N: N ids in every feature (1000000: 26M ids, Criteo scale)"
)


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Adds the flags shared by the end-to-end benchmarks (workload size and timing)."""
    p.add_argument("--quick", action="store_true", help="a short run")
    p.add_argument("--steps", type=int, help="batches per timed window (default 10, quick 4)")
    p.add_argument("--rounds", type=int, help="timed windows per variant (default 15, quick 4)")
    p.add_argument("--warmup-steps", type=int, help="warm-up batches (default 10, quick 3)")
    p.add_argument(
        "--examples",
        type=int,
        help="examples to generate (default: enough that no batch is trained twice)",
    )
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    p.add_argument("--seed", type=int, default=0, help="data seed")


def finish_run_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fills in the defaults of `add_run_args`'s flags that depend on `--quick`."""
    defaults = (4, 4, 3) if args.quick else (10, 15, 10)
    for name, default in zip(("steps", "rounds", "warmup_steps"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.steps < 2 or args.warmup_steps < 2 or args.rounds < 1:
        raise SystemExit("--steps and --warmup-steps must be >= 2, --rounds >= 1")
    if args.examples is None:
        args.examples = (args.warmup_steps + args.rounds * args.steps) * args.batch_size
    return args


# ---------------------------------------------------------------------------------------------
# Reporting


def workload(optimizer: str, batch_size: int, vocab_sizes: Sequence[int]) -> str:
    """The workload cell of a results table."""
    return (
        f"DLRM train, {OPTIMIZER_NAMES[optimizer]} lr {LEARNING_RATE}, batch {batch_size}, "
        f"dim {EMBEDDING_DIM}, {sum(vocab_sizes):,} ids"
    )


def command_line() -> str:
    """This process's command line, quoted for a shell."""
    return shlex.join([sys.executable, *sys.argv])


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or `platform.processor()`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(gpu: bool = False) -> str:
    """One-cell machine description: cores, CPU model, whether a GPU was used."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores, {cpu_model()}, GPU: {'yes' if gpu else 'no'}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; cells are converted with `str`."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join("---" for _ in headers) + " |",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_rate(x: float) -> str:
    """Examples/s with thousands separators."""
    return f"{x:,.0f}"


def fmt_ratio(x: float) -> str:
    """A ratio such as `4.12×`."""
    return f"{x:.2f}×"


def details_table(results: dict[str, Result], extra: dict[str, str] | None = None) -> str:
    """Per-variant details: median, spread, CPU efficiency, windows, final loss, notes.

    "ex per CPU-s" divides by the process's CPU time instead of wall time: it
    moves less than ex/s when other processes share the cores, and shows how
    much CPU a variant burns (a variant that leaves a core idle scores higher
    here than on wall time).
    """
    rows = [
        [
            name,
            fmt_rate(r.examples_per_s),
            f"{100 * r.spread:.0f}%",
            fmt_rate(r.examples_per_cpu_s),
            len(r.windows),
            f"{r.loss:.4f}",
            (extra or {}).get(name, ""),
        ]
        for name, r in results.items()
    ]
    return markdown_table(
        [
            "variant",
            "median ex/s",
            "spread (max-min)/median",
            "ex per CPU-s",
            "windows",
            "final loss",
            "notes",
        ],
        rows,
    )
