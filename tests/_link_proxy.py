"""Faults of links, in user space on loopback: a TCP proxy in front of a listening port.

A process that should reach a server through a faulty link is given the proxy's port
instead of the server's (a server advertises it: `serve --advertise` and
`--advertise-data-port`; a server's etcd link: its `--coordinator` URL). From a test:

- `cut()` holds every byte in both directions (`cut("in")`: only what the clients send,
  `cut("out")`: only what the target answers), as a partition does: connections stay open,
  senders' buffers fill, nothing arrives. New connections are accepted and held alike.
- `slow(seconds)`: each byte arrives `seconds` after it was sent, in each direction.
- `reset()`: every open connection is closed with a TCP reset.
- `heal()`: held bytes flow again, in order; no delay.
- `flap(seed, ...)`: cut and heal on a seeded schedule, in a thread, for a bounded time.
- `adopt(connection)`: carries a connection accepted by another listener over this link
  (tests/test_etcd_partitions.py sorts a port's connections by who opened them).

No `tc netem` or iptables here (../shared/NOTES.md): this is the tests' fault harness.
`LinkProxy` is a context manager; `close()` stops it and its connections.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from collections import deque

DIRECTIONS = ("in", "out")  # in: client -> target; out: target -> client


class LinkProxy:
    """A proxy on 127.0.0.1 (a free port) in front of 127.0.0.1:`target_port`."""

    def __init__(self, target_port: int, name: str = "") -> None:
        self.target_port, self.name = target_port, name or f"link to {target_port}"
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cond = threading.Condition()
        self._held = dict.fromkeys(DIRECTIONS, False)
        self._delay = 0.0
        self._closed = False
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._flapper: threading.Thread | None = None
        self._start(self._accept)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self, direction: str = "both") -> None:
        """Holds the bytes of `direction` ("in", "out" or "both") until `heal`."""
        if direction not in (*DIRECTIONS, "both"):
            raise ValueError(f"direction must be 'in', 'out' or 'both', not {direction!r}")
        with self._cond:
            for d in DIRECTIONS:
                self._held[d] = self._held[d] or direction in (d, "both")

    def slow(self, seconds: float) -> None:
        """Delays every byte by `seconds` in each direction (0: no delay)."""
        with self._cond:
            self._delay = seconds
            self._cond.notify_all()

    def heal(self) -> None:
        """Lets held bytes and new ones through at once."""
        with self._cond:
            self._held = dict.fromkeys(DIRECTIONS, False)
            self._delay = 0.0
            self._cond.notify_all()

    def reset(self) -> None:
        """Closes every open connection with a TCP reset (RST) on both sides."""
        with self._cond:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            _abort(s)

    def flap(self, seed: int, seconds: float, every: float, cut_for: float) -> None:
        """For `seconds`, cuts the link for `cut_for` seconds in every `every` (each cut
        starting at a seeded offset within its period), then heals it; returns at once."""
        starts = flap_schedule(seed, seconds, every, cut_for)
        began = time.monotonic()

        def run() -> None:
            for start in starts:
                if not self._sleep_until(began + start):
                    return
                self.cut()
                if not self._sleep_until(began + start + cut_for):
                    return
                self.heal()

        self._flapper = self._start(run)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # (wakes the blocked accept)
        except OSError:
            pass
        self._listener.close()
        self.reset()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Inside.

    def _start(self, target, *args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True, name=self.name)
        t.start()
        self._threads.append(t)
        return t

    def _sleep_until(self, when: float) -> bool:
        """Waits until `when` (monotonic); False if the proxy closed meanwhile."""
        with self._cond:
            while not self._closed and time.monotonic() < when:
                self._cond.wait(when - time.monotonic())
            return not self._closed

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            self.adopt(client)

    def adopt(self, client: socket.socket) -> None:
        """Carries `client`, a connection accepted elsewhere, over this link to its target,
        as one accepted on `port` (so one listener can sort its connections onto links)."""
        try:
            target = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        except OSError:
            _abort(client)  # the target is down: as a refused connection
            return
        for s in (client, target):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(None)
        with self._cond:
            if self._closed:
                _abort(client)
                _abort(target)
                return
            self._sockets |= {client, target}
        self._start(self._pump, client, target, "in")
        self._start(self._pump, target, client, "out")

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        """Copies `source` to `sink`, holding and delaying as the link says."""
        queue: deque[tuple[float, bytes]] = deque()  # (due, bytes), in order
        done = threading.Event()

        def deliver() -> None:
            try:
                while True:
                    with self._cond:
                        while True:
                            if self._closed:
                                return
                            if queue and not self._held[direction]:
                                wait = queue[0][0] - time.monotonic()
                                if wait <= 0:
                                    break
                                self._cond.wait(wait)
                            elif done.is_set() and not queue:
                                if sink in self._sockets:  # (not reset: that sends RST)
                                    sink.shutdown(socket.SHUT_WR)  # the source closed
                                return
                            else:
                                self._cond.wait()
                        _, data = queue.popleft()
                    sink.sendall(data)
            except OSError:
                pass  # reset or closed

        sender = threading.Thread(target=deliver, daemon=True, name=f"{self.name} {direction}")
        sender.start()
        try:
            while data := source.recv(1 << 16):
                with self._cond:
                    queue.append((time.monotonic() + self._delay, data))
                    self._cond.notify_all()
        except OSError:
            pass
        finally:
            done.set()
            with self._cond:
                self._cond.notify_all()
            sender.join()


def flap_schedule(seed: int, seconds: float, every: float, cut_for: float) -> list[float]:
    """When each cut of `LinkProxy.flap` starts (seconds from its call): one per period of
    `every`, at a seeded offset that leaves the cut inside its period."""
    if not 0 < cut_for < every:
        raise ValueError(f"need 0 < cut_for < every, got {cut_for} and {every}")
    rng = random.Random(seed)
    return [i * every + rng.uniform(0, every - cut_for) for i in range(int(seconds // every))]


def _abort(s: socket.socket) -> None:
    """Closes `s` with a reset (SO_LINGER 0) rather than a FIN. Its reading thread is
    woken first (SHUT_RD sends nothing): a blocked recv would keep the socket open."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    s.close()
