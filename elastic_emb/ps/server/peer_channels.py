"""`PeerChannels`: the gRPC channels a replicated server keeps open to the other servers
(its backups, its primary, the groups it moves ranges to), one per address."""

from __future__ import annotations

import threading

import grpc

from elastic_emb._proto import ps_pb2_grpc
from elastic_emb.ps.wire import security
from elastic_emb.ps.wire.security import GRPC_OPTIONS, ClientSecurity

__all__ = ["PeerChannels"]

_CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class PeerChannels:
    """A channel to each other server, opened on first use and kept. Thread-safe.

    Args:
        client_security: how to call the other servers (TLS, a token); None: plaintext.
    """

    def __init__(self, client_security: ClientSecurity | None) -> None:
        self._security = client_security
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}  # guarded by _lock

    def channel(self, address: str) -> grpc.Channel:
        """The channel to `address` (opened now if none is open)."""
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = security.channel(address, _CHANNEL_OPTIONS, self._security)
                self._channels[address] = channel
            return channel

    def stub(self, address: str) -> ps_pb2_grpc.ParameterServerStub:
        """A stub of the server at `address`, over its kept channel."""
        return ps_pb2_grpc.ParameterServerStub(self.channel(address))

    def close(self) -> None:
        """Closes every channel (a later `channel` opens a new one)."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
