"""elastic_emb: large sparse embeddings for TensorFlow/Keras.

A drop-in `keras.layers.Embedding` replacement whose rows live in a C++
hash table (in-process by default) with server-side sparse optimizers.
"""

from __future__ import annotations

__version__ = "0.1.0"

import platform
from typing import Any

try:
    import keras
    import tensorflow as _tf
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "elastic_emb needs TensorFlow 2.16-2.21 with Keras 3. Install it with "
        "`pip install 'elastic_emb[tensorflow-cpu]'` (or `[tensorflow]`), or install "
        "tensorflow yourself."
    ) from e

if keras.backend.backend() != "tensorflow":  # pragma: no cover
    raise ImportError(
        "elastic_emb runs on Keras' TensorFlow backend; KERAS_BACKEND is "
        f"{keras.backend.backend()!r}. Unset it or set KERAS_BACKEND=tensorflow."
    )

from elastic_emb import _core, callbacks, data, initializers, models, optimizers, sharding
from elastic_emb.checkpoint import CheckpointError, restore, save
from elastic_emb.layers import Embedding
from elastic_emb.remote import init, shutdown
from elastic_emb.table import Table


class ElasticEmbWarning(UserWarning):
    """Warnings issued by elastic_emb."""


def build_info() -> dict[str, Any]:
    """How this copy of elastic_emb was built and what it runs on."""
    return {
        "version": __version__,
        "compiler": _core.compiler(),
        "cxx_flags": _core.cxx_flags,
        "cuda": bool(_core.with_cuda),
        "threads": _core.pool_threads(),
        "python": platform.python_version(),
        "tensorflow": _tf.__version__,
        "keras": keras.__version__,
    }


__all__ = [
    "CheckpointError",
    "ElasticEmbWarning",
    "Embedding",
    "Table",
    "__version__",
    "build_info",
    "callbacks",
    "data",
    "init",
    "initializers",
    "models",
    "optimizers",
    "restore",
    "save",
    "sharding",
    "shutdown",
]
