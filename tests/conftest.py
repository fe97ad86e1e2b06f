"""Shared fixtures. TensorFlow's C++ logging is quieted before it is imported."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Lets tests import the helpers next to them (e.g. _numpy_reference).
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _outside_the_source_tree(tmp_path, monkeypatch):
    """Runs each test (and the `python -c` children it starts) in a temporary
    directory, so `import elastic_emb` finds the installed package, never the
    uncompiled source tree of the checkout."""
    monkeypatch.chdir(tmp_path)
