"""Shared fixtures. TensorFlow's C++ logging is quieted before it is imported."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Lets tests import the helpers next to them (e.g. _numpy_reference).
sys.path.insert(0, str(Path(__file__).parent))

# `pytest -m quick`: what a contributor runs before pushing (about 2 minutes on 2 cores):
# the table, optimizers, layer, checkpoints, one server and its data plane, bad requests, the
# fault harness's link, the CLI, upgrades and user errors.
# Their tests marked slow stay out. CI runs everything.
QUICK_MODULES = {
    "test_architecture", "test_bad_requests", "test_checkpoint", "test_cli", "test_damaged_files",
    "test_data", "test_data_plane", "test_incremental_checkpoint", "test_link_proxy",
    "test_layer", "test_nonfinite", "test_optimizers", "test_ps_server", "test_row_dtype",
    "test_rows", "test_table", "test_table_policies", "test_upgrades", "test_user_errors",
}  # fmt: skip


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in QUICK_MODULES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(autouse=True)
def _outside_the_source_tree(tmp_path, monkeypatch):
    """Runs each test (and the `python -c` children it starts) in a temporary
    directory, so `import elastic_emb` finds the installed package, never the
    uncompiled source tree of the checkout."""
    monkeypatch.chdir(tmp_path)
