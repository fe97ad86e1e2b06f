"""GPU table kernels: bandwidth of gather and of an Adagrad push, against a device copy.

For each dim, a GPU table (`Table(..., device="gpu")`, Adagrad) reserves
`--rows` rows (4,194,304) and two kernel-only workloads run on it, each
timed against a device-to-device copy (`cudaMemcpyAsync`) of the same number
of bytes, counted the same way (bytes read + bytes written):

1. gather: `GpuTable.gather_rows` of `--n` (1,048,576) uniform random row ids
   into a `(n, dim)` float32 output. Bytes = n·dim·4 read + n·dim·4 written.
   Target: ≥ 0.8× the copy for dim ≥ 64.
2. push: `GpuTable.apply_rows` (dedupe by a stable sort, per-row sum, one
   Adagrad update per distinct row) of n Zipf-distributed row ids (exponent
   1.1, hot rows scattered by a fixed permutation; many duplicates). Bytes =
   grads read (n·dim·4) + value and accumulator read and written per distinct
   row (u·2·dim·4·2). Target: ≥ 0.5× the copy.

Timing: CUDA events (CuPy) around `--batch` back-to-back calls, median over
`--runs` samples. The table's kernels run on the table's own stream, so the
stop event is recorded after `GpuTable.synchronize()`; copies run on CuPy's
stream. "ours" calls the kernels through the table's C++ binding (what the
hooks wrap); "via API" calls the public `gather_rows`/`apply_rows`, whose
argument checks wait for the device (`cudaDeviceSynchronize`) before each
launch, so it adds a per-call host round trip. The arena is not initialised
(a bandwidth test; values do not matter).

Needs CuPy and a CUDA build of elastic_emb with a visible GPU; no TensorFlow.

Usage:
    python bench/gpu_bench.py                      # dims 16..256, ~30 s on an H200
    python bench/gpu_bench.py --dims 64 --runs 5
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import markdown_table

ZIPF_EXPONENT = 1.1
LEARNING_RATE = 0.01
GATHER_TARGET, GATHER_MIN_DIM, PUSH_TARGET = 0.8, 64, 0.5
MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def log(msg: str) -> None:
    """Progress goes to stderr, so stdout holds only the results."""
    print(msg, file=sys.stderr, flush=True)


def median_seconds(
    cp: Any, call: Callable[[], None], sync: Callable[[], None], runs: int, batch: int
) -> float:
    """Median seconds per call: CUDA events around `batch` calls, then `sync`."""
    call()  # warm-up (lazy allocations, module loading)
    sync()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(runs):
        start.record()
        for _ in range(batch):
            call()
        sync()
        stop.record()
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop) / 1e3 / batch)
    return statistics.median(samples)


class Copy:
    """Device-to-device copies of up to `max_bytes` bytes, the reference."""

    def __init__(self, cp: Any, max_bytes: int) -> None:
        self.cp = cp
        self.src = cp.zeros(max_bytes, cp.uint8)
        self.dst = cp.empty(max_bytes, cp.uint8)

    def seconds(self, moved_bytes: int, runs: int, batch: int) -> float:
        """Seconds per copy of `moved_bytes / 2` bytes (read + write = moved_bytes)."""
        cp, nbytes = self.cp, moved_bytes // 2
        stream = cp.cuda.get_current_stream()

        def call() -> None:
            cp.cuda.runtime.memcpyAsync(
                self.dst.data.ptr, self.src.data.ptr, nbytes, MEMCPY_DEVICE_TO_DEVICE, stream.ptr
            )

        return median_seconds(cp, call, stream.synchronize, runs, batch)


def zipf_rows(rng: np.random.Generator, n: int, num_rows: int) -> np.ndarray:
    """n Zipf-distributed row ids in [0, num_rows), hot rows scattered."""
    perm = rng.permutation(num_rows).astype(np.uint32)
    ranks = (rng.zipf(ZIPF_EXPONENT, size=n) - 1) % num_rows
    return perm[ranks]


def kernel_calls(
    cp: Any, table: Any, rows: Any, out: Any, push_rows: Any, grads: Any
) -> dict[str, Any]:
    """Gather and apply callables: through the C++ binding ("ours") and the public API."""
    core, n = table._core, int(rows.size)
    step = iter(range(1, 1 << 31))
    calls = {
        "gather_api": lambda: table.gather_rows(rows, out),
        "push_api": lambda: table.apply_rows(push_rows, grads, LEARNING_RATE, next(step)),
        "gather": lambda: core.gather_rows(rows.data.ptr, n, out.data.ptr),
        "push": lambda: core.apply_rows(
            push_rows.data.ptr, int(push_rows.size), grads.data.ptr, LEARNING_RATE, next(step)
        ),
    }
    # The binding must do what the public hook does; fall back to the hook if not.
    try:
        out.fill(np.nan)
        calls["gather"]()
        table.synchronize()
        direct = cp.asnumpy(out[:4096])
        out.fill(np.nan)
        calls["gather_api"]()
        table.synchronize()
        if not np.array_equal(direct, cp.asnumpy(out[:4096]), equal_nan=True):
            raise RuntimeError("binding and hook disagree")
    except (AttributeError, TypeError, RuntimeError) as e:
        log(f"  kernel binding unusable ({e!r}); timing the public hooks only")
        calls["gather"], calls["push"] = calls["gather_api"], calls["push_api"]
    return calls


def run_dim(cp: Any, copy: Copy, dim: int, args: argparse.Namespace) -> list[list[Any]]:
    from elastic_emb.tables.policies import optimizers
    from elastic_emb.tables.table import Table

    rng = np.random.default_rng(dim)
    n, num_rows = args.n, args.rows
    table = Table(
        dim,
        optimizer=optimizers.Adagrad(learning_rate=LEARNING_RATE),
        initializer="zeros",
        name=f"gpu_bench_{dim}",
        device="gpu",
    )
    t0 = time.perf_counter()
    table.reserve(num_rows)
    log(f"dim {dim}: reserved {num_rows:,} rows in {time.perf_counter() - t0:.2f} s")
    rows = cp.asarray(rng.integers(0, num_rows, size=n).astype(np.uint32))
    out = cp.empty((n, dim), cp.float32)
    push_rows_host = zipf_rows(rng, n, num_rows)
    distinct = int(np.unique(push_rows_host).size)
    push_rows = cp.asarray(push_rows_host)
    cp.random.seed(dim)
    grads = cp.random.standard_normal((n, dim), dtype=cp.float32) * cp.float32(0.01)
    calls = kernel_calls(cp, table, rows, out, push_rows, grads)

    results = []
    gather_bytes = 2 * n * dim * 4
    push_bytes = n * dim * 4 + distinct * (2 * dim * 4) * 2
    for workload, nbytes, target in (
        ("gather", gather_bytes, GATHER_TARGET if dim >= GATHER_MIN_DIM else None),
        ("push", push_bytes, PUSH_TARGET),
    ):
        ours = median_seconds(cp, calls[workload], table.synchronize, args.runs, args.batch)
        api = median_seconds(cp, calls[f"{workload}_api"], table.synchronize, args.runs, 1)
        ref = copy.seconds(nbytes, args.runs, args.batch)
        ratio = ref / ours
        if target is None:
            verdict, target_cell = "n/a", "none (dim < 64)"
        else:
            verdict, target_cell = ("met" if ratio >= target else "missed"), f"≥ {target}×"
        name = (
            f"gather {n:,} uniform rows of {num_rows:,}"
            if workload == "gather"
            else f"push Adagrad {n:,} Zipf rows ({distinct:,} distinct) of {num_rows:,}"
        )
        results.append(
            [
                name,
                dim,
                f"{nbytes / ours / 1e9:,.0f}",
                f"{nbytes / ref / 1e9:,.0f}",
                f"{ratio:.2f}×",
                target_cell,
                verdict,
                f"{nbytes / api / 1e9:,.0f}",
                f"{ours * 1e6:,.0f}",
            ]
        )
        log(f"  {workload}: {ours * 1e6:,.0f} µs, copy {ref * 1e6:,.0f} µs, {ratio:.2f}×")
    del table, rows, out, push_rows, grads, calls
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    return results


def machine_line(cp: Any) -> str:
    from elastic_emb import __version__, _core

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]

    def version(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}"

    return (
        f"machine: {name} ({props['totalGlobalMem'] / 2**30:.0f} GiB), "
        f"CUDA runtime {version(cp.cuda.runtime.runtimeGetVersion())} (CuPy {cp.__version__}), "
        f"driver {version(cp.cuda.runtime.driverGetVersion())}; elastic_emb {__version__} "
        f"({_core.compiler()}, with_cuda={bool(_core.with_cuda)}); NumPy {np.__version__}; "
        f"Python {sys.version.split()[0]}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", default="16,32,64,128,256")
    parser.add_argument("--n", type=int, default=1 << 20, help="rows per call")
    parser.add_argument("--rows", type=int, default=1 << 22, help="rows in the table")
    parser.add_argument("--runs", type=int, default=20, help="samples (the median is reported)")
    parser.add_argument("--batch", type=int, default=5, help="calls per sample")
    args = parser.parse_args(argv)
    dims = [int(d) for d in args.dims.split(",")]

    try:
        import cupy as cp
    except ImportError:
        print("gpu_bench: CuPy is not installed; it times and references the kernels.")
        return 2
    from elastic_emb import _core

    if not getattr(_core, "with_cuda", False) or _core.cuda_device_count() == 0:
        print(
            "gpu_bench: needs a CUDA build of elastic_emb (ELASTIC_EMB_CUDA=1) and a GPU; "
            f"with_cuda={getattr(_core, 'with_cuda', None)}"
        )
        return 2

    started = time.perf_counter()
    # A push moves at most n·dim·4 + n·2·dim·4·2 bytes (every row distinct): 5× a gather's half.
    copy = Copy(cp, max(5 * args.n * d * 4 // 2 for d in dims))
    rows: list[list[Any]] = []
    for dim in dims:
        rows += run_dim(cp, copy, dim, args)
    headers = [
        "workload",
        "dim",
        "ours GB/s",
        "copy GB/s",
        "ratio",
        "target",
        "met/missed",
        "via API GB/s",
        "ours µs/call",
    ]
    print("## GPU table kernels vs. a device-to-device copy of the same bytes\n")
    print(markdown_table(headers, rows))
    print()
    print(machine_line(cp))
    print(
        f"median of {args.runs} samples of {args.batch} calls; bytes = read + written; "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
