"""TLS and token access control between workers and PS servers.

Servers: `elastic-emb serve --tls-cert F --tls-key F [--tls-client-ca F]`
(`server_credentials`; with a client CA, clients must present a certificate
it signed: mutual TLS) and `--auth-tokens FILE` (`Tokens`). Clients:
`ee.init(..., tls_ca=F [, tls_cert=F, tls_key=F], token=T)`
(`ClientSecurity`). Plaintext without tokens stays the default.

A token file has one token per line, `TOKEN ROLE [NAME]`, with `#` comments.
Roles:

- `worker`: what training needs: `Join`, `Leave`, `Pull`, `Push` (and
  their per-server batches `PullRanges`, `PushRanges`), reads
  (`DescribeTables`, `ExportRows`, `Metadata`, `Stats`, `Health`), and
  `CreateTables` of tables that exist already (connecting to them), and
  `CreateTables` and `ImportRows` (without `replace`) of the tables of
  models' dense weights (`ee_dense/...`, `ee.init(dense="ps")`);
- `admin`: everything, including creating tables, `ImportRows`,
  `EraseRows`, `Save` and `Restore`.

A call without a valid token is refused with `UNAUTHENTICATED`, and a
call its role does not allow with `PERMISSION_DENIED`. Nothing changes in
either case, and the audit log, if any, records the attempt.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from elastic_emb import _core

__all__ = [
    "GRPC_OPTIONS",
    "ROLES",
    "SERVICE",
    "Caller",
    "ClientSecurity",
    "Tokens",
    "channel",
    "data_plane_server_tls",
    "peer_security",
    "server_credentials",
]

# The methods each role may call (admin: all).
WORKER_METHODS = frozenset(
    ("Join", "Leave", "Pull", "Push", "PullRanges", "PushRanges", "DescribeTables",
     "ExportRows", "Metadata", "Stats", "Health", "CreateTables")
)  # fmt: skip
ROLES = ("worker", "admin")
SERVICE = "elastic_emb.ps.v1.ParameterServer"
MAX_MESSAGE_BYTES = 1 << 30  # pushes carry every table of a step
MAX_GRPC_MESSAGE_BYTES = (1 << 31) - 1  # (gRPC's lengths are 32-bit signed)


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC's channel options for messages up to `max_message_bytes`, either way."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# Both ends (servers, clients, servers calling each other): large messages.
GRPC_OPTIONS = message_options(MAX_MESSAGE_BYTES)


def _read(path: Any, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e}") from None


def _read_pem(path: Any, what: str) -> bytes:
    """The PEM file `path` (a certificate or a key); ValueError if it is none."""
    data = _read(path, what)
    if b"-----BEGIN " not in data:
        raise ValueError(f"the {what} {path} is not a PEM file (no -----BEGIN line)")
    return data


def server_credentials(
    cert: str | os.PathLike[str], key: str | os.PathLike[str], client_ca: Any = None
) -> grpc.ServerCredentials:
    """TLS credentials of a server: its certificate chain and key (PEM files), and with
    `client_ca` the CA whose certificates clients must present (mutual TLS).

    Raises:
        ValueError: a file cannot be read, or is not PEM.
    """
    pair = (_read_pem(key, "TLS key"), _read_pem(cert, "TLS certificate"))
    ca = None if client_ca is None else _read_pem(client_ca, "client CA certificate")
    return grpc.ssl_server_credentials(
        [pair], root_certificates=ca, require_client_auth=ca is not None
    )


def data_plane_server_tls(
    cert: str | os.PathLike[str], key: str | os.PathLike[str], client_ca: Any = None
) -> Any:
    """The data plane's TLS with the certificates of `server_credentials` (a
    `_core.TlsContext`: the same chain and key, the same client CA required); None when
    this build has no TLS (`_core.with_tls`: OpenSSL was not found when it was built).

    Raises:
        ValueError: a file cannot be read, is not PEM, or the key is not the certificate's.
    """
    if not _core.with_tls:
        return None
    ca = b"" if client_ca is None else _read_pem(client_ca, "client CA certificate")
    return _core.TlsContext.server(
        _read_pem(cert, "TLS certificate"), _read_pem(key, "TLS key"), ca
    )


@dataclasses.dataclass(frozen=True)
class Caller:
    name: str
    role: str


class Tokens:
    """The tokens a server accepts (a token file, see the module docstring).

    Raises:
        ValueError: the file cannot be read, or a line is malformed (naming it).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self._callers: dict[str, Caller] = {}
        for number, line in enumerate(_read(path, "token file").decode().splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            where = f"{path} line {number}"
            if len(fields) not in (2, 3):
                raise ValueError(f"{where}: expected `TOKEN ROLE [NAME]`, got {len(fields)} fields")
            token, role = fields[0], fields[1]
            if role not in ROLES:
                raise ValueError(f"{where}: role {role!r} is not one of {ROLES}")
            if token in self._callers:
                raise ValueError(f"{where}: the token appears twice")
            name = fields[2] if len(fields) == 3 else f"{role}-{number}"
            self._callers[token] = Caller(name, role)
        if not self._callers:
            raise ValueError(f"{path} holds no token")

    def caller(self, metadata: Any) -> Caller | None:
        """The caller whose token the call's metadata carries (`authorization: Bearer T`);
        None without a valid one."""
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                return self._callers.get(value[len("Bearer ") :])
        return None

    def find(self, token: str) -> Caller | None:
        """The caller of `token`; None if it is not one of these tokens."""
        return self._callers.get(token)

    @staticmethod
    def allows(caller: Caller, method: str, workers_may: Callable[[], bool]) -> bool:
        """Whether `caller` may call `method`; `workers_may()` tells whether a
        CreateTables or ImportRows touches only what workers may: tables that exist
        (CreateTables), or the dense-weight tables (`table.DENSE_TABLE_PREFIX`)."""
        if caller.role == "admin":
            return True
        if method in ("CreateTables", "ImportRows"):
            return workers_may()
        return method in WORKER_METHODS


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """How a worker reaches the servers: TLS (with a client certificate for mutual
    TLS) and a token. Build it with `make`."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    token: str | None = None

    @classmethod
    def make(
        cls, tls_ca: Any = None, tls_cert: Any = None, tls_key: Any = None, token: Any = None
    ) -> ClientSecurity | None:
        """The security of `ee.init`'s arguments (files are read now); None for plaintext
        without a token.

        Raises:
            ValueError: a file cannot be read, a certificate without its key (or the
                reverse), a client certificate without `tls_ca`, or a bad token.
        """
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("`tls_cert` and `tls_key` go together (mutual TLS)")
        if tls_cert is not None and tls_ca is None:
            raise ValueError("`tls_cert` needs `tls_ca` (the servers' CA certificate)")
        if token is not None and (not isinstance(token, str) or token.split() != [token]):
            raise ValueError("`token` must be a non-empty string without spaces")
        if tls_ca is None and token is None:
            return None
        return cls(
            ca=None if tls_ca is None else _read_pem(tls_ca, "TLS CA certificate"),
            cert=None if tls_cert is None else _read_pem(tls_cert, "TLS client certificate"),
            key=None if tls_key is None else _read_pem(tls_key, "TLS client key"),
            token=token,
        )

    def data_plane_tls(self) -> Any:
        """The data plane's TLS with this security's certificates (a `_core.TlsContext`:
        trusting `ca`, presenting `cert` for mutual TLS; the server's name checked as gRPC
        does); None without TLS, or when this build has none (`_core.with_tls`).

        Raises:
            ValueError: the certificate and key are not a pair.
        """
        if self.ca is None or not _core.with_tls:
            return None
        return _core.TlsContext.client(self.ca, self.cert or b"", self.key or b"")

    def channel(self, address: str, options: Any) -> grpc.Channel:
        """A channel to `address` with this security."""
        if self.ca is not None:
            credentials = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token is not None:
            channel = grpc.intercept_channel(channel, _Token(self.token))
        return channel


def channel(address: str, options: Any, security: ClientSecurity | None) -> grpc.Channel:
    """A channel to `address`: plaintext, or with `security`."""
    if security is None:
        return grpc.insecure_channel(address, options=options)
    return security.channel(address, options)


def peer_security(
    tls_cert: Any, tls_key: Any, peer_ca: Any, tokens: Tokens | None, peer_token_file: Any
) -> ClientSecurity | None:
    """How a server of a replicated cluster calls the others: over TLS when it serves TLS
    (trusting `peer_ca`, presenting its own certificate), with the token of
    `peer_token_file` when it requires tokens (an admin token of its own token file).

    Raises:
        ValueError: TLS without `peer_ca`, tokens without `peer_token_file`, a token that
            is not an admin token of `tokens`, or a file that cannot be read.
    """
    if tls_cert and not peer_ca:
        raise ValueError(
            "with --coordinator, TLS needs --tls-peer-ca (or --tls-client-ca): the CA of "
            "the other servers' certificates"
        )
    if peer_ca and not tls_cert:
        raise ValueError("--tls-peer-ca needs --tls-cert and --tls-key")
    token = None
    if tokens is not None or peer_token_file:
        if tokens is None or not peer_token_file:
            raise ValueError("--auth-tokens and --peer-token-file go together with --coordinator")
        token = _read(peer_token_file, "peer token file").decode().strip()
        caller = tokens.caller([("authorization", f"Bearer {token}")])
        if caller is None or caller.role != "admin":
            raise ValueError(
                f"the token of {peer_token_file} is not an admin token of {tokens.path}: the "
                "servers of a cluster replicate to each other as admins"
            )
    return ClientSecurity.make(
        peer_ca, tls_cert if peer_ca else None, tls_key if peer_ca else None, token
    )


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """A call's details, with our metadata added."""


class _Token(
    grpc.UnaryUnaryClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
):
    """Adds `authorization: Bearer TOKEN` to every call."""

    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self._metadata],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)
