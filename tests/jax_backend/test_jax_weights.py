"""Keras's weights by value carry the tables' rows on the JAX backend: the tests of
tests/_keras_weights.py (which test_keras_weights.py runs on TensorFlow)."""

from _keras_weights import *  # noqa: F403 (the shared tests)
