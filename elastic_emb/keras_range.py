"""The Keras releases elastic_emb supports, and the check that a Keras internal it relies
on is there (`require`). Imports Keras only when asked, so that modules below the
Keras package (the tables' optimizers) can gate their one use of a Keras internal.
"""

from __future__ import annotations

import re

__all__ = ["LAST_TESTED", "OLDEST", "check_keras", "keras_version", "require", "tested"]

OLDEST = (3, 3)  # the oldest Keras supported (setup.py: keras>=3.3.3)
LAST_TESTED = (3, 15)  # the newest Keras release tested


def keras_version() -> tuple[int, int]:
    """(major, minor) of the Keras imported."""
    import keras

    match = re.match(r"(\d+)\.(\d+)", keras.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def tested() -> str:
    """The Keras releases tested, as text ("3.3 through 3.15")."""
    return f"{OLDEST[0]}.{OLDEST[1]} through {LAST_TESTED[0]}.{LAST_TESTED[1]}"


def check_keras() -> None:
    """Refuses a Keras older than `OLDEST` or other than Keras 3."""
    import keras

    version = keras_version()
    if version[0] != 3 or version < OLDEST:
        raise ImportError(
            f"elastic_emb supports Keras {tested()} (Keras 3); this is Keras "
            f"{keras.__version__}. Install a supported one: pip install 'keras>=3.3.3'"
        )


def require(present: bool, internal: str, use: str) -> None:
    """Raises if a Keras internal elastic_emb relies on (`internal`, for `use`) is missing."""
    if not present:
        import keras

        raise RuntimeError(
            f"Keras {keras.__version__} no longer has {internal}, which elastic_emb uses for "
            f"{use} (tested with Keras {tested()}). Install one of those "
            f"(pip install 'keras<={LAST_TESTED[0]}.{LAST_TESTED[1]}.*') or an elastic_emb "
            "release that supports this Keras."
        )
