"""Registers elastic_emb's Keras classes as soon as Keras is imported.

`keras.models.load_model` and `from_config` find `elastic_emb>Embedding` only
if `elastic_emb.keras.layers` was imported. `import elastic_emb` must be enough,
yet must not import TensorFlow itself (`elastic-emb serve` and `health` never
need it). So the package calls `register_when_keras_loads()`: if Keras is
already imported the classes are registered at once; otherwise a one-shot
import hook registers them right after `import keras` finishes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from elastic_emb.errors import ElasticEmbWarning

__all__ = ["register_when_keras_loads"]

# Per Keras backend, the modules whose import registers Keras classes (decorated with
# keras.saving.register_keras_serializable).
KERAS_MODULES = {
    "tensorflow": ("elastic_emb.keras.layers", "elastic_emb.keras.multi_feature"),
    "jax": ("elastic_emb.keras.on_jax",),
}


def register_when_keras_loads() -> None:
    if "keras" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterKerasImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterKerasImport())


def _register() -> None:
    try:
        import keras

        for module in KERAS_MODULES.get(keras.backend.backend(), ()):
            importlib.import_module(module)
    except Exception as e:  # never break the user's `import keras`
        warnings.warn(
            f"elastic_emb could not register its Keras classes ({type(e).__name__}: {e}); "
            "import elastic_emb.keras.layers before loading models that use them",
            ElasticEmbWarning,
            stacklevel=2,
        )


class _AfterKerasImport(importlib.abc.MetaPathFinder):
    """Finds `keras` with the other finders and registers our classes once it has run."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != "keras":
            return None
        sys.meta_path.remove(self)  # one shot
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_keras = loader.exec_module

        def exec_module(module: Any) -> None:
            run_keras(module)
            _register()

        loader.exec_module = exec_module
        return spec
