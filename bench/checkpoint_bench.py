"""Incremental checkpoints: bytes written and seconds per save, delta against full.

The reference, measured side by side in the same run (the project's BENCH.md):
a full checkpoint (`ee.save(dir)`) of the same table in the same state. Each
round changes a fraction of the rows (one push of random gradients to that
many distinct existing rows), then takes both saves of that state in turns
(the order alternates between rounds): `ee.save(inc_dir, incremental=True)`,
which writes a delta of the changed rows onto the chain started by a base
before the first round, and `ee.save(full_dir)`. Both write to the same file
system and `fsync` every file. Bytes are what a save wrote: its data files
plus its manifest. Seconds are the wall time of the call (snapshot, write,
fsync, checksum). Figures are medians over rounds; a ratio is the median of
per-round ratios (full / delta, so larger is better).

A second table reads back what was written: `ee.restore` of the full
checkpoint against the chain (base + one delta per round, each verified and
applied), and `ee.checkpoint.compact` of the chain.

Check-N-Run (Eisenman et al., NSDI 2022) reports 6-17x less write volume from
incremental checkpoints of recommendation models at Meta.

Usage:
    python bench/checkpoint_bench.py --quick   # ~1 min: 1M rows, dim 16, 3 rounds
    python bench/checkpoint_bench.py           # 1M rows, dims 16 and 64, 5 rounds
    python bench/checkpoint_bench.py --rows 200000 --dims 16 --fractions 0.01 --rounds 3
    python bench/checkpoint_bench.py --quick --ps 2   # the table on 2 local PS servers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import machine, markdown_table

PUSH_CHUNK = 1 << 18  # keys per pull or push when filling a table


def log(msg: str) -> None:
    """Progress messages go to stderr, so stdout holds only the tables."""
    print(msg, file=sys.stderr, flush=True)


def mb(n: float) -> str:
    return f"{n / 1e6:,.2f}"


def seconds(x: float) -> str:
    return f"{x:.3f}"


def ratio(x: float) -> str:
    return f"{x:.1f}×"


def _manifests(directory: Path) -> list[tuple[str, dict]]:
    """(part name, manifest) of a checkpoint's parts ("" for an ordinary checkpoint)."""
    manifest = json.loads((directory / "manifest.json").read_text())
    if "parts" not in manifest:
        return [("", manifest)]
    return [
        (p.rsplit("/", 1)[-1], json.loads((directory / p / "manifest.json").read_text()))
        for p in manifest["parts"]
    ]


def written_bytes(directory: Path, previous: set[str]) -> int:
    """Bytes of the checkpoint's data files not in `previous`, plus its manifests."""
    top = json.loads((directory / "manifest.json").read_text())
    parts = [directory / p for p in top.get("parts", [])]
    total = sum((d / "manifest.json").stat().st_size for d in [directory, *parts])
    for part, manifest in _manifests(directory):
        for entry in manifest["tables"].values():
            links = entry.get("links", [entry])
            total += sum(
                link["bytes"] for link in links if f"{part}/{link['file']}" not in previous
            )
    return total


def data_files(directory: Path) -> set[str]:
    """Every data file of the checkpoint, as "part/file" (a cloned part keeps its names)."""
    files = set()
    for part, manifest in _manifests(directory):
        for entry in manifest["tables"].values():
            files |= {f"{part}/{link['file']}" for link in entry.get("links", [entry])}
    return files


@contextlib.contextmanager
def servers(n: int) -> Iterator[list[str]]:
    """`n` local `elastic-emb serve` processes (none for n = 0); their addresses."""
    if n == 0:
        yield []
        return
    from elastic_emb.ps.coord.local_cluster import cli_command, free_port

    ports = sorted({free_port() for _ in range(4 * n)})[:n]
    procs = [
        subprocess.Popen(
            [*cli_command(), "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    try:
        yield [f"127.0.0.1:{port}" for port in ports]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()


def make_table(ee: Any, name: str, rows: int, dim: int, optimizer: str, seed: int) -> Any:
    """A table of `rows` random keys, each pushed once (so its optimizer slots are set)."""
    opt = {"adagrad": ee.optimizers.Adagrad(0.05), "adam": ee.optimizers.Adam(0.001)}[optimizer]
    table = ee.Table(dim=dim, optimizer=opt, initializer="uniform", name=name, seed=seed)
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, 2**62, size=rows + rows // 100, dtype=np.int64))[:rows]
    rng.shuffle(keys)
    for start in range(0, rows, PUSH_CHUNK):
        chunk = keys[start : start + PUSH_CHUNK]
        table.pull(chunk, train=True)
        table.push(chunk, rng.normal(size=(chunk.size, dim)).astype(np.float32))
    return table, keys


def bench_one(ee: Any, args: argparse.Namespace, dim: int, fraction: float, root: Path) -> dict:
    """Rounds of (change `fraction` of the rows, delta save, full save) on one table."""
    name = f"bench_d{dim}_f{fraction}"
    table, keys = make_table(ee, name, args.rows, dim, args.optimizer, args.seed)
    inc_dir, full_dir = root / f"{name}-incremental", root / f"{name}-full"
    t0 = time.perf_counter()
    ee.save(inc_dir, tables=[table], incremental=True, max_deltas=args.rounds + 1)
    base_seconds = time.perf_counter() - t0
    base_bytes = written_bytes(inc_dir, set())
    rng = np.random.default_rng(args.seed + 1)
    changed = max(1, round(fraction * args.rows))
    full_b, full_s, delta_b, delta_s = [], [], [], []
    for r in range(args.rounds):
        rows = rng.choice(keys, size=changed, replace=False)
        for start in range(0, changed, PUSH_CHUNK):
            chunk = rows[start : start + PUSH_CHUNK]
            table.push(chunk, rng.normal(size=(chunk.size, dim)).astype(np.float32))
        order = ("delta", "full") if r % 2 == 0 else ("full", "delta")
        for variant in order:
            if variant == "delta":
                before = data_files(inc_dir)
                t0 = time.perf_counter()
                ee.save(inc_dir, tables=[table], incremental=True, max_deltas=args.rounds + 1)
                delta_s.append(time.perf_counter() - t0)
                delta_b.append(written_bytes(inc_dir, before))
            else:
                t0 = time.perf_counter()
                ee.save(full_dir, tables=[table])
                full_s.append(time.perf_counter() - t0)
                full_b.append(written_bytes(full_dir, set()))
        log(
            f"dim {dim}, {fraction:.0%} changed, round {r + 1}: full {mb(full_b[-1])} MB "
            f"{seconds(full_s[-1])} s, delta {mb(delta_b[-1])} MB {seconds(delta_s[-1])} s"
        )
    # Read back: the full checkpoint and the chain, in turns; then compact the chain.
    fresh = ee.Table(
        dim=dim, optimizer=table.optimizer, initializer="uniform", name=name, seed=table.seed
    )
    restore_full, restore_chain = [], []
    for r in range(args.restore_rounds):
        for variant in ("full", "chain") if r % 2 == 0 else ("chain", "full"):
            t0 = time.perf_counter()
            ee.restore(full_dir if variant == "full" else inc_dir, tables=[fresh])
            (restore_full if variant == "full" else restore_chain).append(time.perf_counter() - t0)
    links = max(len(m["tables"][name]["links"]) for _, m in _manifests(inc_dir))
    t0 = time.perf_counter()
    ee.checkpoint.compact(inc_dir)
    compact_s = time.perf_counter() - t0
    ee.restore(inc_dir, tables=[fresh])  # the compacted chain: the live table, bit for bit
    live, back = table.export_state(), fresh.export_state()
    a, b = np.argsort(live.keys), np.argsort(back.keys)
    for field in ("keys", "values", "slots", "last_step", "update_count"):
        assert np.array_equal(getattr(live, field)[a], getattr(back, field)[b]), field
    assert live.iterations == back.iterations
    del table, fresh
    shutil.rmtree(inc_dir)
    shutil.rmtree(full_dir)
    return {
        "dim": dim,
        "fraction": fraction,
        "changed": changed,
        "base_bytes": base_bytes,
        "base_seconds": base_seconds,
        "full_bytes": statistics.median(full_b),
        "delta_bytes": statistics.median(delta_b),
        "bytes_ratio": statistics.median(f / d for f, d in zip(full_b, delta_b, strict=True)),
        "full_seconds": statistics.median(full_s),
        "delta_seconds": statistics.median(delta_s),
        "time_ratio": statistics.median(f / d for f, d in zip(full_s, delta_s, strict=True)),
        "links": links,
        "restore_full": statistics.median(restore_full),
        "restore_chain": statistics.median(restore_chain),
        "compact_seconds": compact_s,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~1 min: dim 16, 3 rounds")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the table")
    p.add_argument("--dims", type=int, nargs="+", help="embedding dims (default 16 64; quick 16)")
    p.add_argument(
        "--fractions", type=float, nargs="+", default=[0.01, 0.1], help="rows changed per round"
    )
    p.add_argument("--optimizer", choices=["adagrad", "adam"], default="adagrad")
    p.add_argument("--rounds", type=int, help="saves of each kind (default 5, quick 3)")
    p.add_argument("--restore-rounds", type=int, default=3, help="restores of each kind")
    p.add_argument("--dir", help="where to write (default: a new directory under $TMPDIR)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ps", type=int, default=0, help="the table on this many local PS servers (0: in-process)"
    )
    args = p.parse_args(argv)
    if args.dims is None:
        args.dims = [16] if args.quick else [16, 64]
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import elastic_emb as ee

    load_start = os.getloadavg()[0]
    root = Path(args.dir or tempfile.mkdtemp(prefix="ee-checkpoint-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        with servers(args.ps) as addresses:
            if addresses:
                ee.init(ps=addresses, mode="async", connect_timeout=120)
            try:
                for dim in args.dims:
                    for fraction in args.fractions:
                        results.append(bench_one(ee, args, dim, fraction, root))
            finally:
                ee.shutdown()
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    info = ee.build_info()
    command = " ".join(
        ["python bench/checkpoint_bench.py", *(sys.argv[1:] if argv is None else argv)]
    )
    print(
        f"`{command}`: elastic_emb {info['version']} ({info['compiler']}, {info['threads']} "
        f"threads), NumPy {np.__version__}; machine: {machine()}; written to {root} "
        f"(fsync'ed); 1-min load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at "
        "end\n"
    )
    opt = args.optimizer.capitalize()
    where = f"on {args.ps} PS servers (each writes its part)" if args.ps else "in-process"
    print(
        f"Bytes and seconds per save: {args.rows:,} rows {where}, float32, {opt} "
        f"(slots {'1' if args.optimizer == 'adagrad' else '2'} × dim), one push to the changed "
        f"rows before each save; medians over {args.rounds} rounds\n"
    )
    print(
        markdown_table(
            [
                "dim",
                "rows changed",
                "full: MB",
                "delta: MB",
                "bytes full / delta",
                "full: s",
                "delta: s",
                "time full / delta",
            ],
            [
                (
                    r["dim"],
                    f"{r['fraction']:.0%} ({r['changed']:,})",
                    mb(r["full_bytes"]),
                    mb(r["delta_bytes"]),
                    ratio(r["bytes_ratio"]),
                    seconds(r["full_seconds"]),
                    seconds(r["delta_seconds"]),
                    ratio(r["time_ratio"]),
                )
                for r in results
            ],
        )
    )
    print(
        f"\nReading back: `ee.restore` of the full checkpoint and of the chain (base + "
        f"{args.rounds} deltas), medians over {args.restore_rounds} turns each; one "
        "`ee.checkpoint.compact` of the chain; the base save that started the chain\n"
    )
    print(
        markdown_table(
            [
                "dim",
                "rows changed",
                "restore full: s",
                "restore chain: s",
                "chain / full",
                "compact: s",
                "base save: MB, s",
            ],
            [
                (
                    r["dim"],
                    f"{r['fraction']:.0%}",
                    seconds(r["restore_full"]),
                    seconds(r["restore_chain"]),
                    ratio(r["restore_chain"] / r["restore_full"]),
                    seconds(r["compact_seconds"]),
                    f"{mb(r['base_bytes'])}, {seconds(r['base_seconds'])}",
                )
                for r in results
            ],
        )
    )
    log(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
