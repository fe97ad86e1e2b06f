"""Trains the mixed model of `_unfused` under MirroredStrategy (2 logical CPUs), fused and
unfused; writes both results to the .npz files named on the command line."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import numpy as np  # noqa: E402
from _unfused import UnfusedEmbedding, train  # noqa: E402

import elastic_emb as ee  # noqa: E402


def main() -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    np.savez(sys.argv[1], **train(ee.Embedding, "fused", strategy))
    np.savez(sys.argv[2], **train(UnfusedEmbedding, "unfused", strategy))


if __name__ == "__main__":
    main()
