"""The fault harness's link (tests/_link_proxy.py) against a plain TCP echo server: what it
passes, holds, delays and resets, measured on the bytes themselves."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from _link_proxy import LinkProxy, flap_schedule


@pytest.fixture
def echo():
    """A TCP echo server on 127.0.0.1; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # (a reset ends it)
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def _connect(proxy: LinkProxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read(s: socket.socket, n: int, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while len(out) < n and (chunk := s.recv(n - len(out))):
            out += chunk
    except TimeoutError:
        pass
    return out


def test_bytes_pass_through_both_ways(echo):
    with LinkProxy(echo) as proxy, _connect(proxy) as s:
        payload = bytes(range(256)) * 4000  # 1 MB, in many segments
        threading.Thread(target=s.sendall, args=(payload,), daemon=True).start()
        assert _read(s, len(payload), 10) == payload


@pytest.mark.parametrize("direction", ["both", "in", "out"])
def test_a_cut_holds_bytes_until_it_heals_then_delivers_them_in_order(echo, direction):
    with LinkProxy(echo) as proxy, _connect(proxy) as s:
        s.sendall(b"before")
        assert _read(s, 6, 5) == b"before"
        proxy.cut(direction)
        s.sendall(b"during")
        assert _read(s, 6, 0.5) == b""  # held: in the request, or in the echo
        proxy.heal()
        assert _read(s, 6, 5) == b"during"
        with _connect(proxy) as fresh:  # a connection made during a cut is held alike
            proxy.cut(direction)
            fresh.sendall(b"new")
            assert _read(fresh, 3, 0.5) == b""
            proxy.heal()
            assert _read(fresh, 3, 5) == b"new"


def test_a_cut_in_one_direction_lets_the_other_flow(echo):
    """A half-open link, seen by a target that speaks first (no echo needed)."""
    greeter = socket.create_server(("127.0.0.1", 0))

    def greet() -> None:
        conn, _ = greeter.accept()
        with conn:
            conn.sendall(b"hello")
            time.sleep(2)

    threading.Thread(target=greet, daemon=True).start()
    with LinkProxy(greeter.getsockname()[1]) as proxy:
        proxy.cut("in")  # what the client sends is held; what the target sends is not
        with _connect(proxy) as s:
            assert _read(s, 5, 5) == b"hello"
    greeter.close()


def test_a_slow_link_delays_each_byte_by_its_delay(echo):
    with LinkProxy(echo) as proxy, _connect(proxy) as s:
        proxy.slow(0.2)
        started = time.monotonic()
        s.sendall(b"x")
        assert _read(s, 1, 5) == b"x"
        round_trip = time.monotonic() - started
        assert 0.4 <= round_trip < 2.0, round_trip  # 0.2 s each way
        proxy.heal()
        started = time.monotonic()
        s.sendall(b"y")
        assert _read(s, 1, 5) == b"y"
        assert time.monotonic() - started < 0.2


def test_a_reset_closes_open_connections_and_new_ones_work(echo):
    with LinkProxy(echo) as proxy:
        s = _connect(proxy)
        s.sendall(b"a")
        assert _read(s, 1, 5) == b"a"
        proxy.reset()
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            s.settimeout(5)
            for _ in range(100):  # the reset arrives; a send or a read then fails
                s.sendall(b"b")
                if not s.recv(1):
                    raise ConnectionResetError("closed")
                time.sleep(0.01)
        s.close()
        with _connect(proxy) as again:
            again.sendall(b"c")
            assert _read(again, 1, 5) == b"c"


def test_flapping_follows_its_seeded_schedule(echo):
    """Cut 0.3 s in every 1 s for 3 s: bytes sent every 50 ms arrive late within the cuts
    only, and the link is healed at the end. The schedule is the seed's alone."""
    assert flap_schedule(3, 3, 1.0, 0.3) == flap_schedule(3, 3, 1.0, 0.3)
    assert flap_schedule(3, 3, 1.0, 0.3) != flap_schedule(4, 3, 1.0, 0.3)
    starts = flap_schedule(3, 3, 1.0, 0.3)
    assert len(starts) == 3 and all(i <= t <= i + 0.7 for i, t in enumerate(starts))
    with LinkProxy(echo) as proxy, _connect(proxy) as s:
        proxy.flap(seed=3, seconds=3, every=1.0, cut_for=0.3)
        late = 0
        end = time.monotonic() + 3.5
        while time.monotonic() < end:
            sent = time.monotonic()
            s.sendall(b"z")
            assert _read(s, 1, 2) == b"z"
            late += time.monotonic() - sent > 0.1
            time.sleep(0.05)
        assert 3 <= late <= 3 * 8, late  # each cut holds a few of the 50 ms probes
        s.sendall(b"after")
        assert _read(s, 5, 1) == b"after"  # healed at the end
