"""A network namespace for one worker process, whose every link to this machine's
listeners goes through a `LinkProxy` (tests/_link_proxy.py) of its own.

Inside the namespace 127.0.0.1 is its own loopback: a process started there
(`WorkerNamespace.command`) reaches nothing of the host but the ports `forward` puts there.
`forward(port)` makes a listener on 127.0.0.1:`port` inside the namespace (from a thread
that enters it with setns(2); a socket keeps the namespace it was made in) and hands each
connection it accepts to a `LinkProxy`, whose own connection to 127.0.0.1:`port` is made
from the host. So a worker can be cut from a server while the server's other peers (its
backup, etcd), which reach it directly on the host, are not.

Needs root and iproute2's `ip`; `WorkerNamespace` skips the test (pytest.skip) otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import socket
import subprocess
import threading

import pytest
from _link_proxy import LinkProxy

CLONE_NEWNET = 0x40000000
_numbers = itertools.count()


class WorkerNamespace:
    """A context manager: a new network namespace with its loopback up, removed on exit
    with every listener and proxy `forward` made."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"ee-worker-{os.getpid()}-{next(_numbers)}"
        self.links: dict[int, LinkProxy] = {}  # port -> the link of its connections
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._made = False

    def __enter__(self) -> WorkerNamespace:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            pytest.skip("a network namespace needs root and iproute2's `ip`")
        made = subprocess.run(["ip", "netns", "add", self.name], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot make a network namespace: {made.stderr.strip()}")
        self._made = True
        try:
            subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def forward(self, port: int, name: str = "") -> LinkProxy:
        """Makes 127.0.0.1:`port` inside the namespace lead to 127.0.0.1:`port` of the host,
        through the returned link (one per port: cut it to cut that way)."""
        listener = self._listen_inside(port)
        self._listeners.append(listener)
        link = LinkProxy(port, name or f"worker -> {port}")
        self.links[port] = link
        t = threading.Thread(
            target=self._accept, args=(listener, link), daemon=True, name=f"netns {port}"
        )
        t.start()
        self._threads.append(t)
        return link

    def close(self) -> None:
        for listener in self._listeners:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # (wakes the blocked accept)
            listener.close()
        for t in self._threads:
            t.join(timeout=5)
        for link in self.links.values():
            link.close()
        self._listeners, self._threads, self.links = [], [], {}
        if self._made:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            self._made = False

    def _listen_inside(self, port: int) -> socket.socket:
        """A listener on 127.0.0.1:`port` of the namespace, made by a thread that enters it
        (setns changes only the calling thread's namespace; that thread then ends)."""
        made: list[socket.socket | BaseException] = []

        def make() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY)
                try:
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        errno = ctypes.get_errno()
                        raise OSError(errno, f"setns: {os.strerror(errno)}")
                finally:
                    os.close(fd)
                made.append(socket.create_server(("127.0.0.1", port)))
            except BaseException as e:  # (raised again in the caller's thread)
                made.append(e)

        t = threading.Thread(target=make, name=f"netns {self.name} listen {port}")
        t.start()
        t.join()
        (result,) = made
        if isinstance(result, BaseException):
            raise result
        return result

    @staticmethod
    def _accept(listener: socket.socket, link: LinkProxy) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            link.adopt(client)
