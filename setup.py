"""Builds elastic_emb and its private C++ extension elastic_emb._core."""

import os
import re
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

HERE = Path(__file__).parent
CXX_FLAGS = ["-O3", "-fno-math-errno", "-fvisibility=hidden"]


def cuda_objects() -> list[str]:
    """Object files of optional CUDA kernels to link into _core.

    The CPU build links none. GPU kernels (csrc/*.cu) are compiled here with
    nvcc when `ELASTIC_EMB_CUDA` asks for them; see docs/architecture.md.
    """
    if os.environ.get("ELASTIC_EMB_CUDA", "0") not in ("0", "auto"):
        raise RuntimeError("ELASTIC_EMB_CUDA=1: this release has no CUDA kernels yet")
    return []


def version() -> str:
    text = (HERE / "elastic_emb" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


core = Pybind11Extension(
    "elastic_emb._core",
    sorted(str(p) for p in Path("csrc").glob("*.cc")),
    cxx_std=17,
    extra_compile_args=CXX_FLAGS,
    extra_objects=cuda_objects(),
    define_macros=[
        ("EE_CXX_FLAGS", '"' + " ".join(CXX_FLAGS) + '"'),
        ("EE_WITH_CUDA", "0"),
    ],
)

setup(
    name="elastic_emb",
    version=version(),
    description="Large sparse embeddings for TensorFlow/Keras on a C++ hash-table parameter server",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["elastic_emb", "elastic_emb.*"]),
    package_data={"elastic_emb": ["py.typed", "_core.pyi", "_proto/*.pyi"]},
    ext_modules=[core],
    cmdclass={"build_ext": build_ext},
    # TensorFlow is an extra so that installing never pulls a second
    # TensorFlow next to the user's `tensorflow` or `tensorflow-cpu`.
    # grpcio and protobuf are TensorFlow's own dependencies too; the generated
    # code in elastic_emb/_proto works with protobuf 4.25 through 7.x.
    install_requires=["numpy>=1.23", "grpcio>=1.59", "protobuf>=4.25.1,<8"],
    extras_require={
        "tensorflow": ["tensorflow>=2.16,<2.22"],
        "tensorflow-cpu": ["tensorflow-cpu>=2.16,<2.22"],
        "test": ["pytest>=7", "ruff>=0.6", "mypy>=1.10", "clang-format>=18", "pyyaml>=6"],
    },
    entry_points={"console_scripts": ["elastic-emb=elastic_emb.cli:main"]},
    zip_safe=False,
)
