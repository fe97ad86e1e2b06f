"""Trains the same model with and without MirroredStrategy on 2 logical CPUs.

Prints MATCH when losses, dense weights and table rows agree within 1e-6.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import elastic_emb as ee  # noqa: E402


def train(strategy, name):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 40, (96, 3)).astype(np.int64)
    y = rng.normal(size=(96, 1)).astype(np.float32)
    with strategy.scope():
        layer = ee.Embedding(4, optimizer=ee.optimizers.Adagrad(0.1), name=name, seed=3)
        inp = keras.Input((3,), dtype="int64")
        dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=1))
        model = keras.Model(inp, dense(keras.layers.Flatten()(layer(inp))))
        model.compile(keras.optimizers.Adam(0.01), "mse")
    losses = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"]
    state = layer.table.export_state()
    order = np.argsort(state.keys)
    return losses, state, order, model.get_weights()


def main():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    l1, s1, o1, w1 = train(tf.distribute.get_strategy(), "single")
    l2, s2, o2, w2 = train(strategy, "mirrored")
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    np.testing.assert_array_equal(s2.keys[o2], s1.keys[o1])
    np.testing.assert_allclose(s2.values[o2], s1.values[o1], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s2.slots[o2], s1.slots[o1], rtol=1e-6, atol=1e-7)
    assert s1.iterations == s2.iterations == 12
    for a, b in zip(w1, w2, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    print("MATCH")


if __name__ == "__main__":
    main()
