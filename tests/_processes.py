"""Runs Python children for the cross-process tests."""

import os
import subprocess
import sys
from pathlib import Path


def run_python(
    *args: str | Path,
    cwd: Path | None = None,
    timeout: int = 300,
    env: dict[str, str] | None = None,
) -> str:
    """Runs `python ARGS...` quietly, fails the test on a non-zero exit, returns stdout."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout
