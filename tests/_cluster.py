"""Real `elastic-emb serve` processes on 127.0.0.1 for the tests, always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def serve_command() -> list[str]:
    """`elastic-emb serve`: the installed console script, next to this Python."""
    script = Path(sys.executable).parent / "elastic-emb"
    return [str(script)] if script.exists() else [sys.executable, "-m", "elastic_emb.cli"]


def serve_once(*args: str) -> subprocess.CompletedProcess:
    """`elastic-emb serve --port 0 --host 127.0.0.1 ARGS`, for settings that must make
    it stop at once (its output captured)."""
    return subprocess.run(
        [*serve_command(), "serve", "--port", "0", "--host", "127.0.0.1", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


class Shard:
    """One running PS shard; its output is kept for failure messages."""

    def __init__(self, extra_args: list[str]) -> None:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
        env.pop("ELASTIC_EMB_PS", None)
        self.process = subprocess.Popen(
            [*serve_command(), "serve", "--port", "0", "--host", "127.0.0.1", *extra_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.output: list[str] = []
        ready = threading.Event()
        self.address = ""

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.output.append(line)
                if line.startswith("elastic-emb serve: listening on") and not ready.is_set():
                    self.address = line.rsplit(" ", 1)[-1].strip()
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(120) or not self.address:
            self.stop()
            raise RuntimeError("elastic-emb serve did not start:\n" + "".join(self.output))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@contextlib.contextmanager
def shards(n: int, extra_args: list[str] | None = None) -> Iterator[list[Shard]]:
    """Starts `n` shards (in parallel) and stops them on exit."""
    started: list[Shard] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            started.append(Shard(extra_args or []))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        yield started
    finally:
        for shard in started:
            shard.stop()


@contextlib.contextmanager
def connected_shards(n: int, mode: str = "sync") -> Iterator[list[Shard]]:
    """Starts `n` shards and `ee.init`s this process on them; disconnects and stops them."""
    import elastic_emb as ee

    with shards(n) as ps:
        ee.init(ps=[s.address for s in ps], mode=mode)
        try:
            yield ps
        finally:
            ee.shutdown()


def scrape(url: str, context=None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `/metrics`: (name, sorted labels) -> value; `context`: an
    `ssl.SSLContext` trusting an HTTPS server's CA."""
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metrics_url(shard) -> str:
    """The metrics address a shard printed (the line comes before it serves)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in list(shard.output):
            if line.startswith("elastic-emb serve: metrics on "):
                return line.rsplit(" ", 1)[1].strip()
        time.sleep(0.05)
    raise AssertionError("no metrics address in:\n" + "".join(shard.output))
