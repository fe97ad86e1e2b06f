"""The JAX tests: collected only where Keras runs on JAX (`.ci/jax`, their own venv).

`KERAS_BACKEND=jax pytest tests/jax_backend` runs them; under the TensorFlow backend (the
README's test command) they are left out, since one process holds one Keras backend.
"""

import os

os.environ.setdefault("JAX_ENABLE_X64", "1")  # int64 ids (elastic_emb.keras.on_jax)
# Two CPU devices, for keras.distribution.DataParallel (one device unless a test sets one).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

collect_ignore_glob = [] if os.environ.get("KERAS_BACKEND") == "jax" else ["test_*.py"]
