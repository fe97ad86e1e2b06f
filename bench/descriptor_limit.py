"""What a data-plane server spends at its process's descriptor limit.

Starts a `_core.DataPlaneServer` in a child process whose soft limit of open files is
`--limit`, opens `--connections` connections to it (more than it can hold), and prints
the child's CPU seconds per second over `--seconds` while nothing else happens.

    python bench/descriptor_limit.py [--limit 64] [--connections 100] [--seconds 3]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVER = """
import resource, sys
from elastic_emb import _core
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
options = _core.DataPlaneOptions()
options.max_connections = 100000
server = _core.DataPlaneServer(options, lambda *a: (0, b"ok"), lambda t, p: (True, "c"))
print(server.port, flush=True)
sys.stdin.read()
"""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in ticks of 10 ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--connections", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER.format(limit=args.limit)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        peers = [
            socket.create_connection(("127.0.0.1", port), timeout=5)
            for _ in range(args.connections)
        ]
        time.sleep(1)
        before = _cpu_seconds(server.pid)
        time.sleep(args.seconds)
        spent = (_cpu_seconds(server.pid) - before) / args.seconds
        print(
            f"server CPU {spent:.2f} s per second, {len(peers)} connections at a "
            f"{args.limit}-descriptor limit"
        )
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.kill()


if __name__ == "__main__":
    main()
