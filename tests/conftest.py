"""Shared fixtures. TensorFlow's C++ logging is quieted before it is imported."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Lets tests import the helpers next to them (e.g. _numpy_reference).
sys.path.insert(0, str(Path(__file__).parent))
