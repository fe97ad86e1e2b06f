"""GPU-resident tables: `ee.Table(..., device="gpu")`.

Values and optimizer slots live in GPU memory; pulls gather and pushes apply
the optimizer with CUDA kernels (csrc/device_kernels.cu). The key index stays
on the host. Arrays may be numpy arrays or GPU arrays of any framework that
speaks DLPack or `__cuda_array_interface__` (CuPy, PyTorch, TensorFlow via
`tf.experimental.dlpack`); results can stay on the GPU as a `DeviceArray`.
Checkpoints of GPU and CPU tables are interchangeable.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from elastic_emb import _core
from elastic_emb.tables.local import LocalTable, core_options
from elastic_emb.tables.table import TableConfig, check_keys

__all__ = ["DeviceArray", "GpuTable", "available"]

_KDL_CUDA = 2
_DLPACK_CODES = {np.dtype(np.float32): (2, 32), np.dtype(np.int64): (0, 64)}
_DLPACK_CODES[np.dtype(np.uint32)] = (1, 32)


def available() -> bool:
    """Whether this build has CUDA and a GPU is visible."""
    return bool(_core.with_cuda) and _core.cuda_device_count() > 0


class DeviceArray:
    """A C-contiguous array in GPU memory owned by elastic_emb.

    Speaks DLPack (`cupy.from_dlpack(a)`, `torch.from_dlpack(a)`,
    `tf.experimental.dlpack.from_dlpack(a.__dlpack__())`) and
    `__cuda_array_interface__`; `.numpy()` copies it to the host.
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.ptr = int(_core.device_malloc(self.nbytes))

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            _core.device_free(ptr)

    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        _core.copy_to_host(out, self.ptr)
        return out

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_KDL_CUDA, 0)

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        # Our kernels have finished when a call returns: no stream to wait on.
        code, bits = _DLPACK_CODES[self.dtype]
        return _core.to_dlpack(self.ptr, list(self.shape), code, bits, 0, self)


class _DeviceInput:
    """A GPU array argument: its pointer, kept alive while in use."""

    def __init__(self, value: Any, name: str, dtype: Any, shape: tuple[int, ...]) -> None:
        self.owner = value
        dtype = np.dtype(dtype)
        if hasattr(value, "__cuda_array_interface__"):
            cai = value.__cuda_array_interface__
            got_dtype, got_shape = np.dtype(cai["typestr"]), tuple(cai["shape"])
            strides = cai.get("strides")
            contiguous = strides is None or tuple(strides) == _c_strides(got_shape, got_dtype)
            self.ptr = int(cai["data"][0])
        else:
            capsule = value if _is_capsule(value) else value.__dlpack__()
            self.owner = (value, capsule)
            info = _core.dlpack_info(capsule)
            if info["device_type"] != _KDL_CUDA:
                raise ValueError(
                    f"`{name}` must be a GPU array; DLPack device type {info['device_type']}"
                )
            got_dtype = _dtype_of(info["code"], info["bits"], info["lanes"])
            got_shape = tuple(info["shape"])
            strides = info["strides"]
            contiguous = strides is None or tuple(strides) == tuple(
                s // got_dtype.itemsize for s in _c_strides(got_shape, got_dtype)
            )
            self.ptr = int(info["data"])
        if got_dtype != dtype:
            raise ValueError(f"`{name}` must have dtype {dtype}. Received dtype={got_dtype}")
        if any(want >= 0 and want != got for want, got in zip(shape, got_shape, strict=False)) or (
            len(shape) != len(got_shape)
        ):
            raise ValueError(f"`{name}` must have shape {shape} (-1: any). Received {got_shape}")
        if not contiguous:
            raise ValueError(f"`{name}` must be C-contiguous")
        self.shape = got_shape
        # Work queued on the producer's streams must finish before our kernels read.
        _core.device_synchronize()


def _c_strides(shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, ...]:
    strides, step = [], dtype.itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def _dtype_of(code: int, bits: int, lanes: int) -> np.dtype:
    kinds = {0: "i", 1: "u", 2: "f"}
    if code not in kinds or lanes != 1:
        return np.dtype("V1")
    return np.dtype(f"{kinds[code]}{bits // 8}")


def _is_capsule(value: Any) -> bool:
    return type(value).__name__ == "PyCapsule"


def _on_device(value: Any) -> bool:
    return (
        hasattr(value, "__cuda_array_interface__")
        or _is_capsule(value)
        or (hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray))
    )


class GpuTable(LocalTable):
    """A table whose rows and optimizer slots live in GPU memory.

    Created by `ee.Table(..., device="gpu")`; the in-process table's interface
    and results (optimizer formulas shared with the CPU core, float32 sums of
    duplicate keys in the same order), plus GPU array inputs and outputs.

    Raises:
        RuntimeError: this build has no CUDA, or no GPU is visible.
    """

    device = "gpu"

    def __init__(self, config: TableConfig) -> None:
        policies = config.policies()
        unsupported = [
            k for k in ("admission", "eviction", "row_dtype", "storage") if k in policies
        ]
        if unsupported:
            raise ValueError(
                f"device='gpu' tables have no {' or '.join(unsupported)} yet: use a CPU table "
                f"(device='cpu') for table {config.name!r}, or leave {unsupported[0]} at its "
                "default"
            )
        if not _core.with_cuda:
            raise RuntimeError(
                "elastic_emb was built without CUDA, so device='gpu' is unavailable; rebuild "
                "with nvcc on the PATH (ELASTIC_EMB_CUDA=1 pip install .)"
            )
        if _core.cuda_device_count() == 0:
            raise RuntimeError("device='gpu': no CUDA device is visible")
        self._device = _core.DeviceTable(core_options(config))
        super().__init__(config, core=self._device)

    def pull(self, keys: Any, train: bool = True, device_output: bool = False) -> Any:
        """Rows of `keys` (numpy or GPU int64 `(n,)`): numpy float32 `(n, dim)`,
        or a `DeviceArray` with `device_output=True`."""
        k = self._host_keys(keys)
        if not device_output:
            return self._core.pull(k, bool(train))
        out = DeviceArray((len(k), self.dim), np.float32)
        self._device.pull_to_device(k, out.ptr, bool(train))
        return out

    def push(self, keys: Any, grads: Any) -> None:
        """One optimizer step; `grads` float32 `(n, dim)`, numpy or a GPU array.

        GPU gradients are copied to the host once, to check that they are
        finite (`nonfinite`), then applied from the GPU array.
        """
        k = self._host_keys(keys)
        if not _on_device(grads):
            super().push(k, grads)
            return
        g = _DeviceInput(grads, "grads", np.float32, (len(k), self.dim))
        host = np.empty(g.shape, np.float32)
        _core.copy_to_host(host, g.ptr)
        self._push(k, g.ptr, self._device.push_from_device, host_grads=host)

    def _host_keys(self, keys: Any) -> np.ndarray:
        if not _on_device(keys):
            return check_keys(keys)
        device_keys = _DeviceInput(keys, "keys", np.int64, (-1,))
        host = np.empty(device_keys.shape, np.int64)
        _core.copy_to_host(host, device_keys.ptr)
        return host

    # Kernel-only entry points, for benchmarks: no key index, no metadata.

    @property
    def capacity(self) -> int:
        """Rows the GPU arena holds now."""
        return int(self._device.capacity)

    def reserve(self, num_rows: int) -> None:
        """Grows the GPU arena to at least `num_rows` rows."""
        self._device.reserve(int(num_rows))

    def gather_rows(self, rows: Any, out: Any) -> None:
        """out[i] = arena row rows[i]: uint32 `(n,)` and float32 `(n, dim)` GPU arrays."""
        r = _DeviceInput(rows, "rows", np.uint32, (-1,))
        o = _DeviceInput(out, "out", np.float32, (r.shape[0], self.dim))
        self._device.gather_rows(r.ptr, r.shape[0], o.ptr)
        self._device.synchronize()

    def apply_rows(self, rows: Any, grads: Any, learning_rate: float, step: int) -> None:
        """One optimizer step on arena rows (duplicates summed); GPU arrays."""
        r = _DeviceInput(rows, "rows", np.uint32, (-1,))
        g = _DeviceInput(grads, "grads", np.float32, (r.shape[0], self.dim))
        self._device.apply_rows(r.ptr, r.shape[0], g.ptr, float(learning_rate), int(step))
        self._device.synchronize()

    def synchronize(self) -> None:
        """Waits for the table's GPU work."""
        self._device.synchronize()
