"""Catching a receiver up with a primary after a snapshot: `ChangeBuffers` keep the
changes the primary makes meanwhile (for a joining backup, or for the group a range moves
to), and `drain_then_cutover` sends them until few are left, then, between two changes,
sends the last ones and makes the cutover (the backup's admission, the range's new group)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

from elastic_emb._proto import ps_pb2

__all__ = ["FEW_CHANGES", "ChangeBuffers", "drain_then_cutover"]

# The changes left to send that the cutover sends while every change waits.
FEW_CHANGES = 16

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class ChangeBuffers(Generic[K]):
    """Per receiver (`K`: its address, or a range id), the changes made since its snapshot.

    Thread-safe: guarded by `cond`, the replica's (`ReplicaState.cond`), so that
    opening a buffer and reading the state it starts from are one step. `on_change` is
    called (with `cond` held) when a buffer opens or closes.
    """

    def __init__(self, cond: threading.Condition, on_change: Callable[[], None]) -> None:
        self._cond = cond
        self._on_change = on_change
        self._buffers: dict[K, list[ps_pb2.ReplicateRequest]] = {}  # guarded by _cond

    def __contains__(self, key: K) -> bool:
        with self._cond:
            return key in self._buffers

    def __bool__(self) -> bool:
        """Whether any buffer is open."""
        with self._cond:
            return bool(self._buffers)

    def open(self, key: K) -> None:
        """Starts buffering for `key` (a snapshot for it was just taken)."""
        with self._cond:
            self._buffers[key] = []
            self._on_change()

    def add(self, change: ps_pb2.ReplicateRequest, key: K) -> None:
        """Buffers `change` for `key`, if buffering for it."""
        with self._cond:
            if key in self._buffers:
                self._buffers[key].append(change)

    def add_to_all(self, change: ps_pb2.ReplicateRequest) -> None:
        with self._cond:
            for buffered in self._buffers.values():
                buffered.append(change)

    def take(self, key: K) -> list[ps_pb2.ReplicateRequest]:
        """The changes buffered for `key`; buffering goes on."""
        with self._cond:
            changes, self._buffers[key] = self._buffers[key], []
            return changes

    def close(self, key: K) -> list[ps_pb2.ReplicateRequest]:
        """The last changes buffered for `key`; buffering stops."""
        with self._cond:
            changes = self._buffers.pop(key)
            self._on_change()
            return changes

    def discard(self, key: K) -> None:
        """Stops buffering for `key` (a copy or a move that failed)."""
        with self._cond:
            if self._buffers.pop(key, None) is not None:
                self._on_change()


def drain_then_cutover(
    order: AbstractContextManager[Any],
    buffers: ChangeBuffers[K],
    key: K,
    send: Callable[[list[ps_pb2.ReplicateRequest]], None],
    cutover: Callable[[], T],
) -> tuple[T, float]:
    """Sends `key`'s buffered changes until fewer than `FEW_CHANGES` are left (or they stop
    getting fewer: changes come as fast as they are sent), then, holding `order` (between
    two changes), the last ones and `cutover()`, closing the buffer.

    Returns `cutover()`'s result and the seconds `order` was held (the changes waited).
    """
    before = None
    while True:  # the changes made meanwhile, until few are left
        changes = buffers.take(key)
        send(changes)
        if len(changes) < FEW_CHANGES or (before is not None and len(changes) >= before):
            break
        before = len(changes)
    with order:  # the last ones, and the cutover, between two changes
        began = time.monotonic()
        send(buffers.close(key))
        result = cutover()
        return result, time.monotonic() - began
