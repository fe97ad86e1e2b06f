"""elastic_emb: large sparse embeddings for TensorFlow/Keras.

A drop-in `keras.layers.Embedding` replacement whose rows live in a C++
hash table (in-process by default, or on parameter-server shards after
`ee.init`) with server-side sparse optimizers.

Names load on first use, so tools that need no TensorFlow (`elastic-emb
health`) start fast. Tables (`Table`, `optimizers`, `initializers`,
`checkpoint`, `gpu`, and remote tables after `init`) work without
TensorFlow/Keras; the Keras layers, callbacks, data pipeline and models need
them. The module map is in docs/architecture.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

import importlib
import platform
from typing import TYPE_CHECKING, Any

# Imported first: `Table(...)` asks the placement where a new table lives.
from elastic_emb import placement as _placement  # noqa: F401
from elastic_emb.errors import ElasticEmbWarning
from elastic_emb.keras_registration import register_when_keras_loads as _register_keras
from elastic_emb.table import Table

# `keras.models.load_model` finds ee.Embedding after `import elastic_emb` alone.
_register_keras()

# Public submodules, by attribute: those that need TensorFlow with Keras 3,
# and those that work without it (remote tables aside).
_TF_SUBMODULES = {
    "callbacks": "elastic_emb.callbacks",
    "data": "elastic_emb.examples.criteo",
    "keras_patches": "elastic_emb.keras_patches",
    "layers": "elastic_emb.layers",
    "models": "elastic_emb.examples.dlrm",
    "serving": "elastic_emb.serving",
    "serving_delta": "elastic_emb.serving_delta",
}
_PLAIN_SUBMODULES = {
    name: f"elastic_emb.{name}"
    for name in (
        "admission",
        "checkpoint",
        "eviction",
        "gpu",
        "initializers",
        "optimizers",
        "placement",
        "shard_queue",
        "sharding",
        "storage",
        "table",
    )
}
_SUBMODULES = _TF_SUBMODULES | _PLAIN_SUBMODULES
_NAMES = {
    "CheckpointError": "elastic_emb.checkpoint",
    "restore": "elastic_emb.checkpoint",
    "save": "elastic_emb.checkpoint",
    "DistributedEmbedding": "elastic_emb.multi_feature",
    "Embedding": "elastic_emb.layers",
    "apply_delta": "elastic_emb.serving_delta",
    "export_delta": "elastic_emb.serving_delta",
    "export_saved_model": "elastic_emb.layers",
    "export_rows": "elastic_emb.rows",
    "init": "elastic_emb.placement",
    "lookahead": "elastic_emb.layers",
    "shutdown": "elastic_emb.placement",
}


_tensorflow_checked = False


def _check_tensorflow() -> None:
    """Raises a clear ImportError unless TensorFlow with Keras 3 on its TF backend is there."""
    global _tensorflow_checked
    if _tensorflow_checked:
        return
    try:
        import keras
        import tensorflow  # noqa: F401
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
    _tensorflow_checked = True


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        if name in _TF_SUBMODULES:
            _check_tensorflow()
        value = importlib.import_module(_SUBMODULES[name])
    elif name in _NAMES:
        if _NAMES[name] in _TF_SUBMODULES.values():
            _check_tensorflow()
        value = getattr(importlib.import_module(_NAMES[name]), name)
    else:
        raise AttributeError(f"module 'elastic_emb' has no attribute {name!r}")
    globals()[name] = value
    return value


def build_info() -> dict[str, Any]:
    """How this copy of elastic_emb was built and what it runs on.

    `cuda`: whether the CUDA kernels were compiled in; `cuda_devices`: GPUs
    visible now. `tensorflow` and `keras` are None where they are not installed.
    """
    from elastic_emb import _core

    return {
        "version": __version__,
        "compiler": _core.compiler(),
        "cxx_flags": _core.cxx_flags,
        "cuda": bool(_core.with_cuda),
        "cuda_devices": _core.cuda_device_count(),
        "threads": _core.pool_threads(),
        "python": platform.python_version(),
        "tensorflow": _version_of("tensorflow"),
        "keras": _version_of("keras"),
    }


def _version_of(module: str) -> str | None:
    """`module.__version__`, or None if it cannot be imported."""
    try:
        return str(importlib.import_module(module).__version__)
    except ImportError:
        return None


if TYPE_CHECKING:
    from elastic_emb import (
        admission,
        callbacks,
        eviction,
        initializers,
        keras_patches,
        optimizers,
        placement,
        shard_queue,
        sharding,
        storage,
    )
    from elastic_emb.checkpoint import CheckpointError, restore, save
    from elastic_emb.examples import criteo as data
    from elastic_emb.examples import dlrm as models
    from elastic_emb.layers import Embedding, export_saved_model, lookahead
    from elastic_emb.placement import init, shutdown
    from elastic_emb.rows import export_rows
    from elastic_emb.serving_delta import apply_delta, export_delta

__all__ = [
    "CheckpointError",
    "ElasticEmbWarning",
    "Embedding",
    "Table",
    "__version__",
    "admission",
    "apply_delta",
    "build_info",
    "callbacks",
    "data",
    "eviction",
    "export_delta",
    "export_rows",
    "export_saved_model",
    "init",
    "initializers",
    "keras_patches",
    "lookahead",
    "models",
    "optimizers",
    "placement",
    "restore",
    "save",
    "shard_queue",
    "sharding",
    "shutdown",
    "storage",
]
