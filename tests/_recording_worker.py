"""A `RecordingWorker` (tests/_history.py) in a process of its own, for tests that start it
elsewhere than the test's process (tests/_netns.py: inside a network namespace).

Usage: python _recording_worker.py COORDINATOR OUT [--mode async|sync] [--seconds S]
[--deadline D]

Pushes until the file OUT.stop appears (or S seconds, default 120, pass), writing its
progress to OUT.progress every 0.1 s ({"acknowledged": n, "failed": m}); then writes its
History to OUT as JSON: {"acknowledged": [[key, time], ...], "failed": [[key, reason], ...]}.
Times are `time.monotonic()`, the whole machine's clock (CLOCK_MONOTONIC; `ip netns exec`
makes no time namespace), so the test compares them with its own.

--deadline D: every call to a server gives up after D seconds (`ee.init(timeout=D)`, less
the minute a call's deadline adds to it), so that a cut longer than D makes calls fail.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).parent))

from _history import RecordingWorker, history_table

import elastic_emb as ee
from elastic_emb.ps.client import range_router


def _write(path: Path, content: object) -> None:
    """Writes `content` as JSON to `path` whole (a reader never sees half of it)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(content))
    part.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("coordinator")
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", default="async")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--deadline", type=float)
    args = parser.parse_args()
    stop = args.out.with_name(args.out.name + ".stop")
    progress = args.out.with_name(args.out.name + ".progress")

    timeout = 300.0  # (ee.init's default)
    if args.deadline is not None:
        assert hasattr(range_router, "_RPC_MARGIN_SECONDS"), "the margin was renamed"
        range_router._RPC_MARGIN_SECONDS = 0.0
        timeout = args.deadline
    ee.init(coordinator=args.coordinator, mode=args.mode, timeout=timeout)
    worker = RecordingWorker(history_table("h"))
    end = time.monotonic() + args.seconds
    while not stop.exists() and time.monotonic() < end:
        h = worker.history
        _write(progress, {"acknowledged": len(h.acknowledged), "failed": len(h.failed)})
        time.sleep(0.1)
    history = worker.stop()
    _write(args.out, {"acknowledged": history.acknowledged, "failed": history.failed})
    ee.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
