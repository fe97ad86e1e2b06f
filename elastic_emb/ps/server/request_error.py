"""`RequestError`: a request a shard refuses, raised before anything changes, with the name
of the gRPC status the servicer answers it with (`invalid` for INVALID_ARGUMENT)."""

from __future__ import annotations

__all__ = ["RequestError", "invalid"]


class RequestError(Exception):
    """A request the shard refuses; `code` names the gRPC status it is answered with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", message)
