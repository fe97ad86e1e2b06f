"""What a server uses, for scaling decisions: memory against its budget, CPU, rows.

`serve --memory-budget BYTES` sets how many bytes the server's tables may
take; the default is `DEFAULT_BUDGET_FRACTION` of the memory this process
may use: the container's limit (cgroup v2 `memory.max`, or v1
`memory.limit_in_bytes`), else the machine's physical memory. The rest is
headroom for the process itself, gRPC buffers and the snapshots a copy or a
move takes. "Used" is what the tables' live rows take (`Table.memory_in_use`:
values, optimizer slots, index; rows moved away or evicted no longer count,
and new rows reuse their memory), which is what grows with new ids; the
process's resident size is reported beside it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "DEFAULT_BUDGET_FRACTION", "cpu_seconds", "default_memory_budget", "memory_limit",
    "parse_bytes", "resident_bytes",
]  # fmt: skip

DEFAULT_BUDGET_FRACTION = 0.7

_CGROUP = Path("/sys/fs/cgroup")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip
# Above this a cgroup v1 limit means "none" (the kernel writes a huge page-aligned number).
_NO_LIMIT = 2**60


def parse_bytes(text: str) -> int:
    """ "12884901888", "12G" (10^9) or "12Gi" (2^30), as Kubernetes writes quantities.

    Raises:
        ValueError: not a positive amount of bytes.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if match is None:
        raise ValueError(f"not an amount of bytes: {text!r} (e.g. 8589934592, 8G or 8Gi)")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value < 1:
        raise ValueError(f"an amount of bytes must be positive. Received: {text!r}")
    return int(value)


def memory_limit(cgroup: Path = _CGROUP) -> tuple[int, str]:
    """(bytes this process may use, where that figure comes from)."""
    limits = [
        (cgroup / "memory.max", "cgroup v2 memory.max"),
        (cgroup / "memory" / "memory.limit_in_bytes", "cgroup v1 memory limit"),
    ]
    for path, what in limits:
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < _NO_LIMIT:
            return int(raw), what
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"


def default_memory_budget(cgroup: Path = _CGROUP) -> tuple[int, str]:
    """(`DEFAULT_BUDGET_FRACTION` of `memory_limit`, how it was derived)."""
    limit, source = memory_limit(cgroup)
    return int(limit * DEFAULT_BUDGET_FRACTION), f"{DEFAULT_BUDGET_FRACTION:g} of {source}"


def resident_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    """CPU seconds this process used (user and system, every thread)."""
    times = os.times()
    return times.user + times.system
