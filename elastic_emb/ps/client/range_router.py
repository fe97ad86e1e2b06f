"""`RangeRouter`: which server serves each slot range of a worker's shards, and the calls
to them. Without a coordinator the ranges are fixed and shard i answers range i; with one
(a `Routing`) a call goes to its range's primary as the cluster map has it now, follows
failovers and moves for up to `failover_timeout` seconds, is made again for ranges that
split meanwhile, and a server's Pulls (Pushes) of several ranges go in one PullRanges
(PushRanges) call."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic_emb.ps.client.shard_client import NotJoined, NotPrimary, RangeChanged, ShardClient
from elastic_emb.ps.wire import protocol
from elastic_emb.ps.wire.security import ClientSecurity
from elastic_emb.tables.sharding import RangeLayout

if TYPE_CHECKING:
    from elastic_emb.ps.client.routing import Routing

__all__ = ["RangeRouter", "RequestMaker"]

# An RPC may wait `timeout` for other workers on the shard; its deadline is longer.
_RPC_MARGIN_SECONDS = 60.0

# Joins of a range one call may make (a server may hear late of an old lapse and drop the
# worker once more).
_MAX_JOINS = 5

# A call's requests for a layout, one per range (None: skip that range).
RequestMaker = Callable[[RangeLayout], list[Any]]


class RangeRouter:
    """The slot ranges of a worker's shards and their servers. Thread-safe.

    Args:
        addresses: the shards' "host:port" (without a coordinator).
        routing: the coordinator's map, or None (fixed, even ranges over `addresses`).
        timeout: seconds a call may wait on the shard (its deadline is a minute longer).
        security: TLS and a token; None: plaintext.
        failover_timeout: seconds a call waits for a range's new primary.
        read_from_backups: reads (Pulls not training) may go to any replica.
        data_plane: "native" or "grpc" (`ShardClient`).
    """

    def __init__(
        self,
        addresses: list[str],
        routing: Routing | None,
        timeout: float,
        security: ClientSecurity | None,
        failover_timeout: float,
        read_from_backups: bool,
        data_plane: str = "native",
    ) -> None:
        # Read-only after construction (`routing` is thread-safe itself).
        self.routing = routing
        self.failover_timeout = failover_timeout
        self.read_from_backups = read_from_backups
        self._layout_lock = threading.Lock()
        # Guarded by _layout_lock: the ranges as last read from the map (fixed without one).
        if routing is None:
            self._layout = RangeLayout.even(len(addresses))
        else:
            self._layout = routing.layout()
            addresses = [routing.primary_of(r) for r in self._layout.ids]
        # The connections (thread-safe itself); its addresses change with `_layout`.
        self.shards = ShardClient(
            addresses,
            timeout=timeout + _RPC_MARGIN_SECONDS,
            retry=routing is None,
            security=security,
            data_plane=data_plane,
        )
        self._reads_lock = threading.Lock()
        self._reads = itertools.count()  # guarded by _reads_lock: round robin over replicas
        # Joins range `range_id` again for a server that no longer counts this elastic
        # worker (`Cluster`); set once, before the first call.
        self.join_again: Callable[[int], None] | None = None

    def layout(self) -> RangeLayout:
        """The slot ranges as the coordinator's map has them now (fixed without one)."""
        with self._layout_lock:
            if self.routing is None:
                return self._layout
            current = self.routing.layout()
            if (current.ids, current.slots) != (self._layout.ids, self._layout.slots):
                self.shards.set_addresses([self.routing.primary_of(r) for r in current.ids])
                self._layout = current
            return self._layout

    def per_range(
        self,
        method: str,
        make: RequestMaker,
        timeout: float | None = None,
        again_if_changed: bool = True,
    ) -> tuple[RangeLayout, list[Any]]:
        """`make(layout)`'s requests (None: skip) to every range; (layout, responses).

        With a coordinator: requests made for ranges that split meanwhile
        are made again for the new ones and re-sent, and so are the whole
        call's when the ranges changed while it ran (`again_if_changed`), so
        that every range hears of it (pushes are de-duplicated by step).
        """
        while True:
            layout = self.layout()
            requests = make(layout)
            if self.routing is None:
                return layout, self.shards.call_all(method, requests, timeout)
            _address_ranges(requests, layout)
            try:
                responses = self._call_per_server(method, requests, timeout)
            except RangeChanged:
                self.routing.wait_for_change(layout.version, 1.0)
                continue
            if not again_if_changed or self.layout().ids == layout.ids:
                return layout, responses

    def call_range(self, range_id: int, method: str, request: Any) -> Any:
        """One request to range `range_id`'s primary (a copy of `request`, naming it)."""
        request = protocol.copy_request(request)
        request.range = range_id
        with self._layout_lock:
            ids = self._layout.ids
        index = ids.index(range_id) if range_id in ids else 0
        return self._call_primary(self._coordinated(), index, method, request, None, range_id)

    def broadcast(self, method: str, request: Any, timeout: float | None = None) -> list[Any]:
        """The same request to every range."""
        return self.per_range(method, lambda layout: [request] * len(layout.ids), timeout)[1]

    def _coordinated(self) -> Routing:
        """The coordinator's map (raises RuntimeError without one)."""
        if self.routing is None:
            raise RuntimeError("elastic_emb: re-routing a call needs a coordinator")
        return self.routing

    def _call_per_server(
        self, method: str, requests: list[Any], timeout: float | None
    ) -> list[Any]:
        """`requests[i]` to range i (None: skip it), concurrently; with a coordinator, a
        server's Pulls (Pushes) go in one PullRanges (PushRanges) call, not one per range."""
        routing = self.routing
        if routing is None or method not in ("Pull", "Push"):
            return self.shards.call_all(method, requests, timeout, call=self._call_range)
        by_server: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            if request is None:
                continue
            alone = (
                method == "Pull"
                and not request.train
                and (self.read_from_backups or routing.hot(request.range))
            )  # spread over the replicas: a call of its own
            server = f"#{i}" if alone else routing.primary_of(request.range)
            by_server.setdefault(server, []).append(i)
        calls: list[Any] = [None] * len(by_server)
        for n, indices in enumerate(by_server.values()):
            calls[n] = [requests[i] if i in indices else None for i in range(len(requests))]
        answers = self.shards.call_all(method, calls, timeout, call=self._call_ranges)
        responses: list[Any] = [None] * len(requests)
        for indices, answer in zip(by_server.values(), answers, strict=True):
            for i in indices:
                responses[i] = answer[i]
        return responses

    def _call_ranges(
        self, n: int, method: str, requests: list[Any], timeout: float | None
    ) -> list[Any]:
        """The requests that are not None, to one server: in one call if several (see
        `_call_per_server`), each on its own (following failovers and moves) if it fails."""
        routing = self._coordinated()
        indices = [i for i, r in enumerate(requests) if r is not None]
        out: list[Any] = [None] * len(requests)
        address = routing.primary_of(requests[indices[0]].range) if indices else ""
        if len(indices) > 1 and address:  # (no primary now: each waits for its own)
            parts = [requests[i] for i in indices]
            ranges = [r.range for r in parts]
            batch = protocol.ranges_request(method, parts)

            def abandon(address: str) -> bool:  # a range moved, or its primary changed
                return any(routing.primary_of(r) != address for r in ranges)

            try:
                answer = self.shards.call(
                    indices[0], f"{method}Ranges", batch, timeout, abandon, address
                )
                for i, part in zip(indices, protocol.response_parts(answer), strict=True):
                    out[i] = part
                return out
            except (ConnectionError, RangeChanged, RuntimeError, NotJoined):  # NotPrimary too
                pass  # each range on its own, as it now stands
        for i in indices:
            out[i] = self._call_range(i, method, requests[i], timeout)
        return out

    def _call_range(self, index: int, method: str, request: Any, timeout: float | None) -> Any:
        """One call to a range's primary, following failovers and moves (a read, with
        `read_from_backups` or to a range with hot slots: maybe to a backup)."""
        routing = self._coordinated()
        if protocol.has_range(request):
            range_id = request.range
        else:
            with self._layout_lock:
                ids = self._layout.ids
            range_id = ids[min(index, len(ids) - 1)]
        spread = self.read_from_backups or routing.hot(range_id)
        if spread and method == "Pull" and not request.train:
            answer = self._call_a_replica(routing, index, method, request, timeout, range_id)
            if answer is not None:
                return answer
        return self._call_primary(routing, index, method, request, timeout, range_id)

    def _call_a_replica(
        self,
        routing: Routing,
        index: int,
        method: str,
        request: Any,
        timeout: float | None,
        range_id: int,
    ) -> Any:
        """The answer of the range's next replica in turn; None if it has none or it failed."""
        replicas = routing.replicas_of(range_id)
        if not replicas:
            return None
        with self._reads_lock:
            turn = next(self._reads)
        address = replicas[turn % len(replicas)]
        try:
            return self.shards.call(index, method, request, timeout, address=address)
        except ConnectionError:  # that server is gone or no replica any more
            return None  # the primary answers

    def _call_primary(
        self,
        routing: Routing,
        index: int,
        method: str,
        request: Any,
        timeout: float | None,
        range_id: int,
    ) -> Any:
        """The range's primary's answer, waiting for a new primary while it has none."""
        deadline = time.monotonic() + self.failover_timeout

        def abandon(address: str) -> bool:  # a stopped (not dead) primary was replaced
            return routing.primary_of(range_id) != address

        joins = 0
        while True:
            version = routing.version
            address = routing.primary_of(range_id)
            try:
                return self.shards.call(index, method, request, timeout, abandon, address)
            except NotJoined:
                joins += 1
                if self.join_again is None or joins > _MAX_JOINS:
                    raise
                self.join_again(range_id)
            except ConnectionError as e:  # NotPrimary too
                left = deadline - time.monotonic()
                lost = None if isinstance(e, NotPrimary) else routing.lost(range_id)
                if lost is not None:
                    raise ConnectionError(f"elastic_emb: {lost}") from None
                if left <= 0:
                    raise ConnectionError(
                        f"{e} (no primary of slot range {range_id} answered for "
                        f"{self.failover_timeout:g} s)"
                    ) from None
                # The server may know less than this worker (a move it has not seen yet).
                wait = 0.02 if isinstance(e, NotPrimary) else 0.25
                if routing.primary_of(range_id) == address:
                    routing.wait_for_change(version, min(left, wait))


def _address_ranges(requests: list[Any], layout: RangeLayout) -> None:
    """Sets `range` of every request that has one to its range's id, in place (a message
    shared by several ranges is copied: each range gets its own)."""
    seen: set[int] = set()
    for i, request in enumerate(requests):
        if request is None or not protocol.has_range(request):
            continue
        if id(request) in seen:
            request = requests[i] = protocol.copy_request(request)
        seen.add(id(request))
        request.range = layout.ids[i]
