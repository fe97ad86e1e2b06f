"""Keras's weights by value carry the tables' rows on the TensorFlow backend: the tests of
tests/_keras_weights.py (which jax_backend/test_jax_weights.py runs on JAX)."""

from _keras_weights import *  # noqa: F403 (the shared tests)
