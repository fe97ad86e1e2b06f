"""A shard's Pull and Push called directly, with numpy arrays in and out (as the servicer
calls them with the messages it received)."""

from __future__ import annotations

import numpy as np

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.server.shard import Shard
from elastic_emb.ps.wire import protocol


def push(
    shard: Shard, worker: int, step: int, parts: list[tuple[str, np.ndarray, np.ndarray]]
) -> int:
    """`Shard.push` of (table, keys, float32 gradients) parts; the shard's step."""
    request = protocol.push_request(worker, step, ps_pb2.FLOAT32, parts)
    return shard.push(protocol.push_message(request))


def pull(
    shard: Shard,
    worker: int,
    step: int,
    train: bool,
    timeout: float,
    keys: list[tuple[str, np.ndarray]],
) -> list[np.ndarray]:
    """`Shard.pull` of (table, keys); the float32 rows of each table."""
    request = protocol.pull_request(worker, step, train, ps_pb2.FLOAT32, timeout, keys)
    response = ps_pb2.PullResponse.FromString(
        shard.pull(protocol.pull_message(request.SerializeToString()), timeout)
    )
    shapes = [(name, len(k), shard.table(name).dim) for name, k in keys]
    return [rows for rows, _, _ in protocol.pulled_rows(response, shapes)]
