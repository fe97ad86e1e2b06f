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

With `--ps N` every variant trains against N parameter servers on 127.0.0.1,
which its worker process starts and owns: `tfra` and `tf_keras` under
TensorFlow's own parameter-server runtime (`ParameterServerStrategy`: the
worker process is the chief, with one TF worker and N TF ps servers; TFRA's
tables spread over the ps devices, stock variables split by a
`MinSizePartitioner`), `ee` with N `elastic-emb serve` shards
(`ee.init(ps=..., mode=--ee-mode)`; async by default, as
ParameterServerStrategy is). All of them read the same batches from a file of
raw records on each window, and a window's time is its whole `fit` call
(ParameterServerStrategy runs steps asynchronously, so per-batch callbacks do
not time them); the CPU counted is every process of the variant's.

Usage:
    bench/peer_tfra_venv.sh                       # once: builds /work/tfra-venv
    /work/tfra-venv/bin/python bench/peer_tfra.py --quick
    /work/tfra-venv/bin/python bench/peer_tfra.py
    /work/tfra-venv/bin/python bench/peer_tfra.py --ps 2 --variants tfra,ee
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

import _common as c
from remote_bench import cpu_seconds

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
    kind: str,
    optimizer: str,
    vocab_sizes: list[int],
    shared_table: bool = False,
    devices: list[str] | None = None,
) -> Any:
    """The DLRM of `elastic_emb.examples.dlrm.build_dlrm`, rebuilt with legacy `tf_keras`.

    Same layers, widths, initializers and seeds; only the embedding layers
    differ: TFRA's dynamic embedding (`kind="tfra"`) or `tf_keras`'s stock one
    (`kind="tf_keras"`). `shared_table`: one layer embeds every feature, ids
    offset as in `_common.build_keras3_dlrm`. `devices`: where TFRA's tables
    live (the ps tasks' CPUs under ParameterServerStrategy).
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
                devices=devices,
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


class RecordStream:
    """Windows of whole batches read from a file of raw records, one record a batch.

    What the variants of `--ps` train on: a dataset that a remote TF worker can
    build itself (ParameterServerStrategy ships the dataset function, not its
    data), and that costs the same to read in every variant.
    """

    def __init__(self, path: str, batch_size: int, num_batches: int) -> None:
        self.path, self.batch_size, self.num_batches = path, batch_size, num_batches
        self._next = 0

    @staticmethod
    def write(path: str, arrays: dict[str, Any], batch_size: int) -> int:
        """Writes `arrays` as records of `batch_size` examples; returns how many."""
        n = len(arrays["labels"]) // batch_size
        with open(path, "wb") as f:
            for b in range(n):
                rows = slice(b * batch_size, (b + 1) * batch_size)
                for name in ("dense", "categorical", "labels"):
                    f.write(arrays[name][rows].tobytes())
        return n

    def dataset(self, start: int) -> Any:
        """The batches from `start` on, repeated."""
        import tensorflow as tf

        b = self.batch_size
        sizes = (b * c.NUM_DENSE * 4, b * c.NUM_CATEGORICAL * 8, b * 4)

        def decode(record: Any) -> Any:
            dense = tf.io.decode_raw(tf.strings.substr(record, 0, sizes[0]), tf.float32)
            cat = tf.io.decode_raw(tf.strings.substr(record, sizes[0], sizes[1]), tf.int64)
            labels = tf.io.decode_raw(
                tf.strings.substr(record, sizes[0] + sizes[1], sizes[2]), tf.float32
            )
            features = {
                "dense": tf.reshape(dense, (b, c.NUM_DENSE)),
                "categorical": tf.reshape(cat, (b, c.NUM_CATEGORICAL)),
            }
            return features, tf.reshape(labels, (b, 1))

        records = tf.data.FixedLengthRecordDataset(self.path, sum(sizes))
        return records.repeat().skip(start).map(decode).prefetch(2)

    def window(self, steps: int) -> int:
        """The first batch of the next `steps` (each window starts where the last stopped)."""
        start = self._next
        self._next = (start + steps) % self.num_batches
        return start


class PsRunner:
    """Trains `model` window by window against parameter servers; times whole `fit` calls.

    `pids`: the variant's other processes (servers), whose CPU counts too.
    `creator`: wraps the dataset function for ParameterServerStrategy's `fit`.
    """

    def __init__(self, model: Any, stream: RecordStream, pids: list[int], creator: Any) -> None:
        self.model, self.stream, self.pids, self.creator = model, stream, pids, creator

    def cpu(self) -> float:
        return time.process_time() + sum(cpu_seconds(p) for p in self.pids)

    def __call__(self, steps: int) -> c.Window:
        start = self.stream.window(steps)
        data = self.creator(lambda _context=None: self.stream.dataset(start))
        wall, cpu = time.perf_counter(), self.cpu()
        history = self.model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
        wall, cpu = time.perf_counter() - wall, self.cpu() - cpu
        examples = steps * self.stream.batch_size
        return c.Window(examples / wall, float(history.history["loss"][-1]), examples / cpu)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tf_server(job: str, index: int, cluster: str) -> None:
    """A TF server of ParameterServerStrategy's cluster (with TFRA's kernels loaded)."""
    import tensorflow as tf
    import tensorflow_recommenders_addons  # noqa: F401  (its tables' kernels, on a ps)

    spec = tf.train.ClusterSpec(json.loads(cluster))
    tf.distribute.Server(spec, job_name=job, task_index=index, protocol="grpc").join()


def ps_runner(variant: str, args: argparse.Namespace, vocab_sizes: list[int]) -> PsRunner:
    """`variant`'s model against `args.ps` servers that this process starts."""
    stream = RecordStream(args.records, args.batch_size, args.num_batches)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if variant == "ee":
        import elastic_emb as ee

        servers = [_free_port() for _ in range(args.ps)]
        serve = [sys.executable, "-m", "elastic_emb.cli", "serve", "--host", "127.0.0.1"]
        procs = [
            subprocess.Popen([*serve, "--port", str(p)], env=env, stdout=subprocess.DEVNULL)
            for p in servers
        ]
        _CHILDREN.extend(procs)
        ee.init(ps=[f"127.0.0.1:{p}" for p in servers], mode=args.ee_mode)
        model = c.build_keras3_dlrm("ee", args.optimizer, vocab_sizes)
        return PsRunner(model, stream, [p.pid for p in procs], lambda fn: fn())
    import tensorflow as tf
    import tf_keras

    cluster = {
        "chief": [f"127.0.0.1:{_free_port()}"],
        "worker": [f"127.0.0.1:{_free_port()}"],
        "ps": [f"127.0.0.1:{_free_port()}" for _ in range(args.ps)],
    }
    server = [sys.executable, os.path.abspath(__file__), "--tf-server"]
    procs = [
        subprocess.Popen(
            [*server, job, str(i), json.dumps(cluster)], env=env, stderr=subprocess.DEVNULL
        )
        for job in ("worker", "ps")
        for i in range(len(cluster[job]))
    ]
    _CHILDREN.extend(procs)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=args.ps
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioner
    )
    devices = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(args.ps)]
    with strategy.scope():
        model = build_tf_keras_dlrm(variant, args.optimizer, vocab_sizes, devices=devices)
    creator = tf_keras.utils.experimental.DatasetCreator
    return PsRunner(model, stream, [p.pid for p in procs], creator)


_CHILDREN: list[subprocess.Popen[Any]] = []  # a worker's servers, killed when it ends


def worker(variant: str, args: argparse.Namespace) -> None:
    """Builds one variant's model, then trains a window per `run STEPS` line on stdin."""
    import tensorflow as tf

    optimizer, batch_size, shared_table = args.optimizer, args.batch_size, args.shared_table
    arrays, vocab_sizes = c.load_data(args.data)
    if VARIANTS[variant] == "legacy":
        import tf_keras as keras_module
    else:
        import keras as keras_module
    if args.ps:
        runner: Any = ps_runner(variant, args, vocab_sizes)
    elif VARIANTS[variant] == "legacy":
        model = build_tf_keras_dlrm(variant, optimizer, vocab_sizes, shared_table)
        runner = c.FitRunner(keras_module, model, c.BatchStream(tf, arrays, batch_size))
    else:
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
    for child in _CHILDREN:
        child.kill()
        child.wait()


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
            *(["--ps", str(args.ps), "--ee-mode", args.ee_mode] if args.ps else []),
            *(["--records", args.records] if args.ps else []),
            *(["--num-batches", str(args.num_batches)] if args.ps else []),
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
    p.add_argument(
        "--ps",
        type=int,
        default=0,
        help="train against this many parameter servers (TFRA and tf_keras under\n"
        "ParameterServerStrategy, elastic_emb on `elastic-emb serve` shards); 0: in-process",
    )
    p.add_argument(
        "--ee-mode", choices=["async", "sync"], default="async", help="elastic_emb's mode with --ps"
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the workers' stderr logs")
    p.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--records", help=argparse.SUPPRESS)
    p.add_argument("--num-batches", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tf-server", nargs=3, help=argparse.SUPPRESS)
    args = c.finish_run_args(p.parse_args(argv))
    if args.ps and args.shared_table:
        raise SystemExit("--ps runs the 26-table model: leave out --shared-table")
    if args.ps and "keras" in args.variants.split(","):
        raise SystemExit("--ps: the variants are tfra, tf_keras and ee")
    return args


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
        if args.ps:
            args.records = os.path.join(tmp, "batches.bin")
            args.num_batches = RecordStream.write(args.records, arrays, args.batch_size)
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
            for path in (data_path, args.records):
                if path and os.path.exists(path):
                    os.remove(path)
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
    setup = (
        f", {args.ps} PS (TF: ParameterServerStrategy, 1 TF worker; elastic_emb: {args.ee_mode})"
        if args.ps
        else ""
    )
    row = [
        c.workload(args.optimizer, args.batch_size, vocab_sizes)
        + (", one shared table" if args.shared_table else "")
        + setup,
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
    if args.tf_server:
        job, index, cluster = args.tf_server
        tf_server(job, int(index), cluster)
    elif args.worker:
        worker(args.worker, args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
