"""End-to-end CTR training throughput against the peer, TensorFlow Recommenders-Addons.

TFRA 0.8.1 supports no TensorFlow newer than 2.16 and only the legacy Keras
(`tf_keras`), so this runs in the venv that `bench/peer_tfra_venv.sh` builds
(tensorflow-cpu 2.16.2, tf-keras 2.16.0, TFRA 0.8.1, elastic_emb). The driver
starts one worker process per variant, all in the same run:

- `tfra`: the DLRM with `tfra.dynamic_embedding.keras.layers.Embedding` and a
  `DynamicEmbeddingOptimizer`-wrapped `tf_keras` optimizer (legacy Keras,
  `TF_USE_LEGACY_KERAS=1`);
- `tf_keras`: the same `tf_keras` model with stock `tf_keras.layers.Embedding`
  sized to the vocabulary (TFRA's in-venv reference);
- `ee`: `elastic_emb.examples.dlrm.build_dlrm` with `ee.Embedding` under Keras 3;
- `keras` (optional): the Keras 3 model with `keras.layers.Embedding`.

The workers load the same generated data, then train in turns, window by
window, on the driver's command, so only one of them uses the CPU at a time.
The driver prints one Markdown table with the ratios.

Usage:
    bench/peer_tfra_venv.sh                       # once: builds /work/tfra-venv
    /work/tfra-venv/bin/python bench/peer_tfra.py --quick
    /work/tfra-venv/bin/python bench/peer_tfra.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import IO, Any

import _common as c

# Keras used by each variant: "legacy" runs with TF_USE_LEGACY_KERAS=1.
VARIANTS = {"tfra": "legacy", "tf_keras": "legacy", "ee": "keras3", "keras": "keras3"}
VARIANT_NAMES = {
    "tfra": "TFRA de.keras.layers.Embedding",
    "tf_keras": "tf_keras.layers.Embedding",
    "ee": "elastic_emb (Keras 3)",
    "keras": "keras.layers.Embedding (Keras 3)",
}
_MARK = "@@bench "  # prefix of the protocol lines a worker writes to stdout


# ---------------------------------------------------------------------------------------------
# Worker side


def build_tf_keras_dlrm(
    kind: str, optimizer: str, vocab_sizes: list[int], shared_table: bool = False
) -> Any:
    """The DLRM of `elastic_emb.examples.dlrm.build_dlrm`, rebuilt with legacy `tf_keras`.

    Same layers, widths, initializers and seeds; only the embedding layers
    differ: TFRA's dynamic embedding (`kind="tfra"`) or `tf_keras`'s stock one
    (`kind="tf_keras"`). `shared_table`: one layer embeds every feature, ids
    offset as in `_common.build_keras3_dlrm`.
    """
    import tensorflow as tf
    import tf_keras

    if kind == "tfra":
        from tensorflow_recommenders_addons import dynamic_embedding as de

        def factory(i: int) -> Any:
            return de.keras.layers.Embedding(
                c.EMBEDDING_DIM,
                key_dtype=tf.int64,
                initializer=tf_keras.initializers.RandomUniform(-0.05, 0.05),
                name=f"c{i}",
            )

    else:

        def factory(i: int) -> Any:
            rows = sum(vocab_sizes) if shared_table else vocab_sizes[i]
            return tf_keras.layers.Embedding(
                rows, c.EMBEDDING_DIM, embeddings_initializer="uniform", name=f"c{i}"
            )

    dense_in = tf_keras.Input(shape=(c.NUM_DENSE,), dtype="float32", name="dense")
    cat_in = tf_keras.Input(shape=(c.NUM_CATEGORICAL,), dtype="int64", name="categorical")
    seed = [0]

    def dense(units: int, activation: str | None, name: str) -> Any:
        seed[0] += 1
        return tf_keras.layers.Dense(
            units,
            activation=activation,
            kernel_initializer=tf_keras.initializers.GlorotUniform(seed=seed[0]),
            name=name,
        )

    x = dense_in
    for i, width in enumerate(c.BOTTOM_MLP):
        x = dense(width, "relu", f"bottom_{i}")(x)
    if shared_table:
        offsets = tf.constant([c.shared_offsets(vocab_sizes)], tf.int64)
        embedded = [tf_keras.layers.Flatten()(factory(0)(cat_in + offsets))]
    else:
        columns = tf.split(cat_in, c.NUM_CATEGORICAL, axis=1)
        embedded = [factory(i)(tf.squeeze(col, axis=1)) for i, col in enumerate(columns)]
    x = tf_keras.layers.Concatenate(axis=1)([x, *embedded])
    for i, width in enumerate(c.TOP_MLP):
        x = dense(width, "relu", f"top_{i}")(x)
    out = dense(1, "sigmoid", "click")(x)
    model = tf_keras.Model({"dense": dense_in, "categorical": cat_in}, out, name="dlrm")

    if optimizer == "adagrad":
        opt = tf_keras.optimizers.Adagrad(learning_rate=c.LEARNING_RATE)
    else:
        opt = tf_keras.optimizers.SGD(learning_rate=c.LEARNING_RATE)
    if kind == "tfra":
        # One optimizer trains both the dense weights and the dynamic embeddings.
        opt = de.DynamicEmbeddingOptimizer(opt)
    model.compile(optimizer=opt, loss="binary_crossentropy")
    return model


def _emit(out: IO[str], kind: str, **payload: Any) -> None:
    out.write(_MARK + json.dumps({"kind": kind, **payload}) + "\n")
    out.flush()


def worker(
    variant: str, optimizer: str, data_path: str, batch_size: int, shared_table: bool
) -> None:
    """Builds one variant's model, then trains a window per `run STEPS` line on stdin."""
    import tensorflow as tf

    arrays, vocab_sizes = c.load_data(data_path)
    if VARIANTS[variant] == "legacy":
        import tf_keras as keras_module

        model = build_tf_keras_dlrm(variant, optimizer, vocab_sizes, shared_table)
    else:
        import keras as keras_module

        model = c.build_keras3_dlrm(variant, optimizer, vocab_sizes, shared_table=shared_table)
    runner = c.FitRunner(keras_module, model, c.BatchStream(tf, arrays, batch_size))
    versions = {"tensorflow": tf.__version__, "keras": keras_module.__version__}
    if variant == "tfra":
        import tensorflow_recommenders_addons as tfra

        versions["tfra"] = tfra.__version__
    elif variant == "ee":
        import elastic_emb

        versions["elastic_emb"] = elastic_emb.__version__
    gpu = bool(tf.config.list_physical_devices("GPU"))
    _emit(sys.stdout, "ready", versions=versions, gpu=gpu)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[:1] == ["run"]:
            w = runner(int(cmd[1]))
            _emit(
                sys.stdout,
                "window",
                examples_per_s=w.examples_per_s,
                loss=w.loss,
                examples_per_cpu_s=w.examples_per_cpu_s,
            )
        elif cmd[:1] == ["quit"]:
            break


# ---------------------------------------------------------------------------------------------
# Driver side


class WorkerProcess:
    """A worker subprocess, driven as a `_common.interleave` runner."""

    def __init__(self, variant: str, args: argparse.Namespace, data_path: str, log_dir: str):
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if VARIANTS[variant] == "legacy":
            env["TF_USE_LEGACY_KERAS"] = "1"
        else:
            env.pop("TF_USE_LEGACY_KERAS", None)
        self.variant = variant
        self.log_path = os.path.join(log_dir, f"{variant}.log")
        self._log = open(self.log_path, "w")  # closed in close()
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            variant,
            "--optimizer",
            args.optimizer,
            "--data",
            data_path,
            "--batch-size",
            str(args.batch_size),
            *(["--shared-table"] if args.shared_table else []),
        ]
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        self.versions: dict[str, str] = {}
        self.gpu = False

    def _read(self, kind: str) -> dict[str, Any]:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(_MARK):
                msg = json.loads(line[len(_MARK) :])
                if msg["kind"] == kind:
                    return msg
        self._proc.wait()
        with open(self.log_path) as f:
            tail = "".join(f.readlines()[-30:])
        raise RuntimeError(
            f"worker {self.variant!r} exited with {self._proc.returncode}; "
            f"end of {self.log_path}:\n{tail}"
        )

    def wait_ready(self) -> None:
        """Blocks until the worker has built its model."""
        msg = self._read("ready")
        self.versions, self.gpu = msg["versions"], msg["gpu"]

    def __call__(self, steps: int) -> c.Window:
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"run {steps}\n")
        self._proc.stdin.flush()
        msg = self._read("window")
        return c.Window(msg["examples_per_s"], msg["loss"], msg["examples_per_cpu_s"])

    def close(self) -> None:
        """Asks the worker to quit (kills it if it does not)."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write("quit\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._log.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    c.add_run_args(p)
    p.add_argument("--vocab", default="default", help=c.VOCAB_HELP)
    p.add_argument("--optimizer", choices=["adagrad", "sgd"], default="adagrad")
    p.add_argument(
        "--variants",
        default="tfra,tf_keras,ee",
        help=f"comma-separated, from: {','.join(VARIANTS)}",
    )
    p.add_argument(
        "--shared-table",
        action="store_true",
        help="one embedding layer (one table) for all 26 features, ids offset per feature",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the workers' stderr logs")
    p.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    return c.finish_run_args(p.parse_args(argv))


def driver(args: argparse.Namespace) -> None:
    """Generates the data, starts the workers, interleaves them and prints the tables."""
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    tmp = tempfile.mkdtemp(prefix="ee-peer-")
    data_path = os.path.join(tmp, "data.npz")
    workers: dict[str, WorkerProcess] = {}
    try:
        arrays, vocab_sizes = c.prepare_data(args, c.parse_vocab(args.vocab))
        c.save_data(data_path, arrays, vocab_sizes)
        del arrays
        for v in variants:
            workers[v] = WorkerProcess(v, args, data_path, tmp)
        for w in workers.values():
            w.wait_ready()
        results = c.interleave(
            {VARIANT_NAMES[v]: w for v, w in workers.items()},
            steps=args.steps,
            rounds=args.rounds,
            warmup_steps=args.warmup_steps,
        )
    finally:
        for w in workers.values():
            w.close()
        if args.keep_logs:
            if os.path.exists(data_path):
                os.remove(data_path)
            print(f"worker logs: {tmp}")
        else:
            shutil.rmtree(tmp)

    def rate(v: str) -> str:
        return c.fmt_rate(results[VARIANT_NAMES[v]].examples_per_s) if v in workers else "-"

    def ratio(a: str, b: str) -> str:
        if a not in workers or b not in workers:
            return "-"
        return c.fmt_ratio(c.paired_ratio(results[VARIANT_NAMES[a]], results[VARIANT_NAMES[b]]))

    versions = {k: v for w in workers.values() for k, v in w.versions.items() if k != "keras"}
    keras_versions = {VARIANTS[v]: w.versions["keras"] for v, w in workers.items()}
    print()
    print(f"`{c.command_line()}`")
    print(
        ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
        + "; "
        + ", ".join(f"{k}: Keras {v}" for k, v in sorted(keras_versions.items()))
        + f"; each variant in its own process; {args.rounds} windows of {args.steps} batches "
        f"after {args.warmup_steps} warm-up batches; ratios: median over rounds of the "
        "ratio within the round"
    )
    print()
    headers = [
        "workload",
        "elastic_emb ex/s",
        "TFRA ex/s",
        "tf_keras ex/s",
        "elastic_emb / TFRA",
        "TFRA / tf_keras",
        "elastic_emb / tf_keras",
    ]
    row = [
        c.workload(args.optimizer, args.batch_size, vocab_sizes)
        + (", one shared table" if args.shared_table else ""),
        rate("ee"),
        rate("tfra"),
        rate("tf_keras"),
        ratio("ee", "tfra"),
        ratio("tfra", "tf_keras"),
        ratio("ee", "tf_keras"),
    ]
    if "keras" in workers:
        headers[4:4] = ["Keras 3 ex/s"]
        row[4:4] = [rate("keras")]
        headers.append("elastic_emb / Keras 3")
        row.append(ratio("ee", "keras"))
    headers.append("machine")
    row.append(c.machine(gpu=any(w.gpu for w in workers.values())))
    print(c.markdown_table(headers, [row]))
    print()
    print(c.details_table(results))


def main(argv: list[str] | None = None) -> None:
    """Entry point: the driver, or one worker when `--worker` is given."""
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.optimizer, args.data, args.batch_size, args.shared_table)
    else:
        driver(args)


if __name__ == "__main__":
    main()
