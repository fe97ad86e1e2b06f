"""Retiring a server without losing anything (`elastic-emb cluster drain`, and a server's
own SIGTERM with a coordinator): a spare takes its place in its group, or the group's slot
ranges move to the other groups."""

from __future__ import annotations

import time

from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.etcd import Etcd
from elastic_emb.ps.coord.membership import DEFAULT_PREFIX, ClusterMap

__all__ = ["drain_server"]


def drain_server(coordinator: str, address: str, timeout: float = 600.0) -> ClusterMap:
    """Retires `address`: a spare takes its place, or its group's ranges move away.

    The map marks it draining (placed nowhere again, not counted as a
    replica). If a spare is free, it joins the group and is copied to; once
    the group has its replicas without `address`, that is removed (a
    primary hands over to a backup, as in a failover). Otherwise the group
    retires (scale-in): its slot ranges move to the other groups, and then
    it dissolves (its other servers become spares). `address` then holds
    nothing and may be stopped. Returns the map.

    Raises:
        ValueError: no such server in the cluster, or nowhere for its slots
            to go (no spare, and no other group).
        TimeoutError: not done within `timeout` (it is not draining any
            more; ranges that moved stay where they went).
    """
    with Etcd(coordinator) as etcd:
        known = ClusterMap.read(etcd).group_of(address) is not None
        if not known and etcd.get(membership.server_key(DEFAULT_PREFIX, address)) is None:
            raise ValueError(f"{address} is not a server of the cluster at {coordinator}")
        registered, _ = etcd.get_prefix(membership.servers_prefix(DEFAULT_PREFIX))
        servers = {kv.key.rsplit("/", 1)[1] for kv in registered}

        def drain(m: ClusterMap) -> ClusterMap:
            m = m.drain(address)
            group = m.group_of(address)
            spares = [a for a in servers if m.group_of(a) is None and a not in m.draining]
            if group is None or m.replaced(address) or spares or group.retiring:
                return m
            if not any(g.id != group.id and not g.retiring for g in m.groups):
                raise ValueError(
                    f"cannot drain {address}: no spare can replace it and its group {group.id} "
                    "is the only one to hold slots; start a server first"
                )
            return m.retire(group.id)

        m, _ = membership.update(etcd, DEFAULT_PREFIX, drain)
        if m.group_of(address) is None:
            return m
        deadline = time.monotonic() + timeout

        def leave(m: ClusterMap) -> ClusterMap | None:
            return m.without(address) if m.group_of(address) and m.replaced(address) else None

        while True:
            m, removed = membership.update(etcd, DEFAULT_PREFIX, leave)
            if removed or m.group_of(address) is None:
                return m
            if time.monotonic() > deadline:
                membership.update(etcd, DEFAULT_PREFIX, lambda m: _stay(m, address))
                group = m.group_of(address)
                raise TimeoutError(
                    f"{address} is still in group {group.id if group else '?'} after "
                    f"{timeout:g} s (no spare replaced it, or its slot ranges are still moving): "
                    f"start a spare (`elastic-emb serve --coordinator {coordinator}`) and drain "
                    "again"
                )
            time.sleep(0.1)


def _stay(m: ClusterMap, address: str) -> ClusterMap | None:
    """A drain given up: `address` is not draining any more, and its group not retiring."""
    new = m.undrain(address)
    group = (new or m).group_of(address)
    if group is None or not group.retiring:
        return new
    new = (new or m).copy()
    new.group(group.id).retiring = False
    return new
