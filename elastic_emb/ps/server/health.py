"""The standard gRPC health service, `grpc.health.v1.Health`, served and asked.

What Kubernetes' gRPC probes and `elastic-emb health` ask a shard. The
messages are our own (protos/elastic_emb/ps/v1/health.proto), wire-compatible
with grpc.health.v1 but in another proto package, so that this module works
next to grpcio-health-checking's `grpc_health` in one process and elastic_emb
needs no such dependency (whose releases pull protobuf >= 5).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from elastic_emb._proto.health_pb2 import HealthCheckRequest, HealthCheckResponse

__all__ = [
    "NOT_SERVING",
    "SERVICE_NAME",
    "SERVICE_UNKNOWN",
    "SERVING",
    "HealthCheckRequest",
    "HealthCheckResponse",
    "HealthServicer",
    "ServingStatus",
    "check",
]

SERVICE_NAME = "grpc.health.v1.Health"
ServingStatus = HealthCheckResponse.ServingStatus
SERVING = HealthCheckResponse.SERVING
NOT_SERVING = HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = HealthCheckResponse.SERVICE_UNKNOWN

# A Watch wakes at least this often (seconds) to see whether its call is still
# active: a safety net only, since the end of a call wakes it at once.
_WATCH_POLL = 5.0


class HealthServicer:
    """The statuses of a server's services ("": the whole server, SERVING at first).

    `add_to_server` registers its Check and Watch as grpc.health.v1.Health.
    Check answers NOT_FOUND for a service it does not know; Watch streams the
    current status (SERVICE_UNKNOWN for such a service), then each change, until
    the client cancels, the call's deadline passes or the server stops.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._statuses: dict[str, ServingStatus] = {"": SERVING}
        self._stopping = False

    def set(self, service: str, status: ServingStatus) -> None:
        """Sets the status of `service` (ignored once a graceful shutdown has begun)."""
        with self._changed:
            if not self._stopping:
                self._statuses[service] = status
                self._changed.notify_all()

    def enter_graceful_shutdown(self) -> None:
        """Sets every service NOT_SERVING for good, and ends each Watch once it has
        sent that (so that open Watch calls do not hold up the server's stop)."""
        with self._changed:
            for service in self._statuses:
                self._statuses[service] = NOT_SERVING
            self._stopping = True
            self._changed.notify_all()

    def Check(self, request: Any, context: Any) -> HealthCheckResponse:
        if not isinstance(request, HealthCheckRequest):  # (`_parse`'s bytes: it did not parse)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED)
        with self._changed:
            status = self._statuses.get(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"unknown service {request.service!r}")
            return HealthCheckResponse()
        return HealthCheckResponse(status=status)

    def Watch(self, request: Any, context: Any) -> Iterator[HealthCheckResponse]:
        if not isinstance(request, HealthCheckRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED)

        def wake() -> None:  # the call ended: cancelled, past its deadline, or the server stopped
            with self._changed:
                self._changed.notify_all()

        context.add_callback(wake)
        sent: ServingStatus | None = None
        while True:
            with self._changed:
                while True:
                    if not context.is_active():
                        return
                    status = self._statuses.get(request.service, SERVICE_UNKNOWN)
                    if status != sent:
                        break
                    if self._stopping:  # the last status is sent, and none will follow
                        return
                    self._changed.wait(_WATCH_POLL)
            sent = status
            yield HealthCheckResponse(status=status)

    def add_to_server(self, server: grpc.Server) -> None:
        """Registers this servicer as grpc.health.v1.Health on `server`."""
        handlers = {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.Check,
                request_deserializer=_parse,
                response_serializer=HealthCheckResponse.SerializeToString,
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self.Watch,
                request_deserializer=_parse,
                response_serializer=HealthCheckResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )


_MALFORMED = "a malformed HealthCheckRequest (service: a UTF-8 string)"


def _parse(raw: bytes) -> HealthCheckRequest | bytes:
    """The request, or its bytes if they do not parse (the method answers INVALID_ARGUMENT;
    a deserializer that fails would make gRPC answer INTERNAL)."""
    try:
        return HealthCheckRequest.FromString(raw)
    except DecodeError:
        return raw


def check(channel: grpc.Channel, service: str = "", timeout: float = 5.0) -> HealthCheckResponse:
    """Asks grpc.health.v1.Health/Check over `channel` for `service` ("": the whole
    server); raises `grpc.RpcError` (NOT_FOUND for a service the server does not know)."""
    call = channel.unary_unary(
        f"/{SERVICE_NAME}/Check",
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )
    response: HealthCheckResponse = call(HealthCheckRequest(service=service), timeout=timeout)
    return response
