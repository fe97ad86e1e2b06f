"""One training worker for the cluster tests: a small DLRM on planted-signal data.

Usage: python _remote_worker.py DATA_DIR OUT.npz --batch B [--ps A,B | --coordinator
URL] [--mode sync --tf-config JSON --kill PID]. Without --ps or --coordinator the
tables are in-process (the reference run). --kill: SIGKILL process PID (a PS
primary) after batch --kill-at-batch of the first epoch.
With a TF_CONFIG of several workers, the dense model runs under
MultiWorkerMirroredStrategy and every worker reads its share of each global
batch; with --dense ps the dense weights train on the PS instead, without a
strategy, and worker i trains on examples i, i + n, ... of n workers.
Writes the dense weights, the test predictions and the per-epoch loss.
"""

import argparse
import json
import os
import signal
import sys

parser = argparse.ArgumentParser()
parser.add_argument("data")
parser.add_argument("out")
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--ps")
parser.add_argument("--mode", default="sync")
parser.add_argument("--tf-config")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument(
    "--coordinator", help="etcd://HOST:PORT of a replicated cluster (instead of --ps)"
)
parser.add_argument("--kill", type=int, help="SIGKILL this PS process at --kill-at-batch")
parser.add_argument("--kill-at-batch", type=int, default=3)
parser.add_argument(
    "--dense", default="local", help="ps: dense weights on the PS, no strategy, data split"
)
args = parser.parse_args()
if args.tf_config:
    os.environ["TF_CONFIG"] = args.tf_config
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import elastic_emb as ee  # noqa: E402
from elastic_emb import data  # noqa: E402
from elastic_emb.examples.dlrm import build_dlrm  # noqa: E402

NUM_CATEGORICAL = 8


def features(path: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    dense, categorical, labels = data.read_criteo(path)
    x = data.model_inputs(dense, categorical[:, :NUM_CATEGORICAL])
    return x, labels.astype(np.float32)


def main() -> int:
    keras.utils.set_random_seed(0)
    remote = args.ps or args.coordinator
    cluster = (
        ee.init(ps=args.ps, coordinator=args.coordinator, mode=args.mode, dense=args.dense)
        if remote
        else None
    )
    multi = cluster is not None and cluster.num_workers > 1 and args.dense == "local"
    strategy = (
        tf.distribute.MultiWorkerMirroredStrategy() if multi else tf.distribute.get_strategy()
    )
    x, y = features(os.path.join(args.data, "train.tsv"))
    x_test, y_test = features(os.path.join(args.data, "test.tsv"))
    if cluster is not None and args.dense == "ps":  # no strategy: each worker its own share
        share = slice(cluster.worker_index, None, cluster.num_workers)
        x, y = {k: v[share] for k, v in x.items()}, y[share]
    with strategy.scope():
        model = build_dlrm(
            lambda i: ee.Embedding(
                8, optimizer=ee.optimizers.Adagrad(0.1), name=f"C{i + 1}", seed=i
            ),
            num_categorical=NUM_CATEGORICAL,
            bottom_mlp=(16,),
            top_mlp=(32,),
        )
        model.compile(keras.optimizers.Adam(3e-3), "binary_crossentropy")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
    callbacks = []
    if args.kill:

        class Kill(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == args.kill_at_batch and not self.killed:
                    os.kill(args.kill, signal.SIGKILL)
                    self.killed = True

            killed = False

        callbacks.append(Kill())
    history = model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=callbacks)
    scores = np.concatenate(
        [
            keras.ops.convert_to_numpy(
                model({k: v[i : i + 4096] for k, v in x_test.items()}, training=False)
            )[:, 0]
            for i in range(0, len(y_test), 4096)
        ]
    )
    np.savez(
        args.out,
        loss=np.array(history.history["loss"]),
        scores=scores,
        auc=data.auc(y_test, scores),
        **{f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())},
    )
    if cluster is None:  # the reference run writes its tables too
        ee.save(os.path.join(os.path.dirname(args.out), "reference_tables"))
    else:
        ee.shutdown()
    print(json.dumps({"auc": float(data.auc(y_test, scores))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
