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

# The first `Table(...)` connects to the parameter servers ELASTIC_EMB_PS names, if any.
from elastic_emb import placement as _placement
from elastic_emb.errors import ElasticEmbWarning
from elastic_emb.keras_registration import register_when_keras_loads as _register_keras
from elastic_emb.tables.table import Table

# `keras.models.load_model` finds ee.Embedding after `import elastic_emb` alone.
_register_keras()
_placement.install()

# Public submodules, by attribute: those that need TensorFlow with Keras 3,
# and those that work without it (remote tables aside).
_TF_SUBMODULES = {
    "callbacks": "elastic_emb.keras.callbacks",
    "data": "elastic_emb.examples.criteo",
    "keras_patches": "elastic_emb.keras.patches",
    "layers": "elastic_emb.keras.layers",
    "models": "elastic_emb.examples.dlrm",
}
_PLAIN_SUBMODULES = {
    "admission": "elastic_emb.tables.policies.admission",
    "checkpoint": "elastic_emb.persistence.checkpoint",
    "eviction": "elastic_emb.tables.policies.eviction",
    "gpu": "elastic_emb.tables.gpu",
    "initializers": "elastic_emb.tables.policies.initializers",
    "optimizers": "elastic_emb.tables.policies.optimizers",
    "placement": "elastic_emb.placement",
    "shard_queue": "elastic_emb.shard_queue",
    "sharding": "elastic_emb.tables.sharding",
    "storage": "elastic_emb.tables.policies.storage",
    "table": "elastic_emb.tables.table",
}
_SUBMODULES = _TF_SUBMODULES | _PLAIN_SUBMODULES
_NAMES = {
    "CheckpointError": "elastic_emb.persistence.checkpoint",
    "restore": "elastic_emb.persistence.checkpoint",
    "save": "elastic_emb.persistence.checkpoint",
    "DistributedEmbedding": "elastic_emb.keras.multi_feature",
    "Embedding": "elastic_emb.keras.layers",
    "apply_delta": "elastic_emb.serving.delta",
    "export_delta": "elastic_emb.keras.models",
    "export_saved_model": "elastic_emb.keras.models",
    "export_rows": "elastic_emb.tables.rows",
    "init": "elastic_emb.placement",
    "lookahead": "elastic_emb.keras.models",
    "shutdown": "elastic_emb.placement",
    "string_keys": "elastic_emb.tables.string_keys",
}


# What works on Keras' JAX backend: in place of its TensorFlow module, or as it is.
_JAX_NAMES = {"Embedding": "elastic_emb.keras.on_jax"}
_JAX_SUBMODULES = {"callbacks"}

_tensorflow_checked = False


def _keras_backend() -> str | None:
    try:
        import keras
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return str(keras.backend.backend())


def _check_tensorflow(name: str) -> None:
    """Raises a clear ImportError unless TensorFlow with Keras 3 on its TF backend is there."""
    global _tensorflow_checked
    if _tensorflow_checked:
        return
    backend = _keras_backend()
    if backend not in (None, "tensorflow"):
        raise ImportError(
            f"ee.{name} runs on Keras' TensorFlow backend; KERAS_BACKEND is {backend!r}. On "
            "JAX, ee.Embedding, ee.Table, ee.save, ee.restore and ee.init work (docs/jax.md); "
            "for the rest set KERAS_BACKEND=tensorflow."
        )
    try:
        import tensorflow  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"ee.{name} needs TensorFlow 2.16-2.21 with Keras 3. Install it with "
            "`pip install '.[tensorflow-cpu]'` (or `'.[tensorflow]'`) in elastic_emb's source "
            "tree, or install tensorflow yourself."
        ) from e
    _tensorflow_checked = True


def __getattr__(name: str) -> Any:
    on_jax = (name in _JAX_NAMES or name in _JAX_SUBMODULES) and _keras_backend() == "jax"
    if on_jax and name in _JAX_NAMES:
        value = getattr(importlib.import_module(_JAX_NAMES[name]), name)
    elif name in _SUBMODULES:
        if name in _TF_SUBMODULES and not on_jax:
            _check_tensorflow(name)
        value = importlib.import_module(_SUBMODULES[name])
    elif name in _NAMES:
        if _NAMES[name] in _TF_SUBMODULES.values() or _NAMES[name].startswith("elastic_emb.keras"):
            _check_tensorflow(name)
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
    from elastic_emb import placement, shard_queue
    from elastic_emb.examples import criteo as data
    from elastic_emb.examples import dlrm as models
    from elastic_emb.keras import callbacks
    from elastic_emb.keras import patches as keras_patches
    from elastic_emb.keras.layers import Embedding
    from elastic_emb.keras.models import export_delta, export_saved_model, lookahead
    from elastic_emb.keras.multi_feature import DistributedEmbedding
    from elastic_emb.persistence.checkpoint import CheckpointError, restore, save
    from elastic_emb.placement import init, shutdown
    from elastic_emb.serving.delta import apply_delta
    from elastic_emb.tables import sharding
    from elastic_emb.tables.policies import admission, eviction, initializers, optimizers, storage
    from elastic_emb.tables.rows import export_rows

__all__ = [
    "CheckpointError",
    "DistributedEmbedding",
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
