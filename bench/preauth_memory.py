"""What unauthenticated peers cost a server's memory on its data port.

Starts a real `elastic-emb serve --auth-tokens` (tokens in a temporary file), opens
`--connections` raw connections to its data port that each announce a hello of
`--announce` bytes and send 1,000 of them, and prints the server's resident memory
(VmRSS) before and `--wait` seconds after, with the first answer the server sent. With
`--tls` the server has a TLS data port, and each peer sends instead the start of a TLS
record of 16 KiB (a handshake never finished).

    python bench/preauth_memory.py [--connections 4] [--announce 1073741824] [--wait 2] [--tls]
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _certs import make_pki
from _cluster import shards  # (the tests' server harness)

from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.wire import security

HEADER = struct.Struct("<IIQIBBH")  # magic, length, request id, deadline ms, method, status
MAGIC, HELLO = 0x50444545, 0


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--announce", type=int, default=1 << 30)
    parser.add_argument("--wait", type=float, default=2.0)
    parser.add_argument("--tls", action="store_true", help="a TLS data port")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp())
    tokens = scratch / "tokens"
    tokens.write_text("s3cret-admin admin ops\n")
    flags, ca = ["--auth-tokens", str(tokens)], None
    if args.tls:
        pki = make_pki(scratch)
        ca, (cert, key) = pki["ca"], pki["server"]
        flags += ["--tls-cert", str(cert), "--tls-key", str(key)]
    with shards(1, flags) as (ps,):
        admin = security.ClientSecurity.make(tls_ca=ca, token="s3cret-admin")
        stub = ps_pb2_grpc.ParameterServerStub(security.channel(ps.address, [], admin))
        port = stub.Health(ps_pb2.HealthRequest(), timeout=10).data_port
        time.sleep(1)
        before = _rss(ps.process.pid)
        peers = []
        for _ in range(args.connections):
            peer = socket.create_connection(("127.0.0.1", port), timeout=5)
            if args.tls:  # a handshake record's header announcing 16 KiB, and 1,000 of them
                peer.sendall(bytes([0x16, 3, 1, 0x40, 0]) + b"x" * 1000)
            else:
                peer.sendall(HEADER.pack(MAGIC, args.announce, 0, 0, HELLO, 0, 0) + b"x" * 1000)
            peers.append(peer)
        time.sleep(args.wait)
        after = _rss(ps.process.pid)
        peers[0].settimeout(1)
        try:
            answer = peers[0].recv(4096)[HEADER.size :].decode(errors="replace") or "(closed)"
        except TimeoutError:
            answer = "(none)"
        what = "a 16 KiB TLS record" if args.tls else f"a {args.announce:,}-byte hello"
        print(
            f"server RSS {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB, "
            f"{args.connections} connections announcing {what}"
        )
        print(f"first answer: {answer}")


if __name__ == "__main__":
    main()
