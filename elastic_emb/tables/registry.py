"""Where a new table lives, and the process's tables by name: the one place that decides.

`Table(...)` (the public constructor) comes here: a table with
`device="gpu"` is a `GpuTable` in this process; otherwise, while this
process is connected to parameter servers (`ee.init`, which lives above the
tables in `elastic_emb.placement` and hands a `Connection` here), a table
made by that connection; otherwise an in-process table (`make_local_table`).
Tables created before a connection stay where they are.

Names: the tables created here are registered by name for `ee.save` and
`ee.restore` (which match tables by name). A new table with the name of a
live one takes the name over: re-running the code that builds a model (a
notebook cell, `clone_model`, `from_config`) gives tables with the same
names, so checkpoints keep matching. The older table keeps working, but is
no longer saved or restored by `ee.save()` / `ee.restore()` without
`tables=`. A table kept alive only by the registry is dropped with it.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

from elastic_emb.tables import table as table_module
from elastic_emb.tables.table import Table, TableConfig
from elastic_emb.tables.tiered import make_local_table

__all__ = [
    "Connection",
    "connect",
    "connection",
    "create_table",
    "current_cluster",
    "disconnect",
    "registered_tables",
    "unregister",
]


@dataclasses.dataclass(frozen=True)
class Connection:
    """What `ee.init` connected this process to, as the tables and layers see it."""

    cluster: Any  # the `elastic_emb.ps.client.cluster.Cluster`
    make_table: Callable[[TableConfig], Table]  # a table on `cluster`
    dense: str = "local"  # where models' dense weights train: "local" or "ps"
    dense_explicit: bool = False  # whether ee.init's caller chose `dense`
    dense_pull_every: int = 1


# Guards every global below; `ee.init` holds it while it connects, so a table
# created meanwhile waits to be placed on the new connection.
LOCK = threading.RLock()
_tables: weakref.WeakValueDictionary[str, Table] = weakref.WeakValueDictionary()
_connection: Connection | None = None
# Connects from the environment (ELASTIC_EMB_PS), once, before the first table
# is placed or the connection is asked for; set by `elastic_emb.placement`.
_from_environment: Callable[[], None] | None = None


def create_table(
    dim: int,
    optimizer: Any = None,
    initializer: Any = "uniform",
    name: str = "table",
    seed: int | None = None,
    device: str = "cpu",
    nonfinite: str = "raise",
    admission: Any = None,
    eviction: Any = None,
    row_dtype: str = "float32",
    storage: Any = None,
) -> Table:
    """`Table(...)`: a new table, placed and registered (arguments as `Table`)."""
    config = TableConfig.make(
        dim, optimizer, initializer, name, seed, nonfinite, admission, eviction, row_dtype, storage
    )
    return place(config, device)


def place(config: TableConfig, device: str = "cpu") -> Table:
    """A new table of `config` where it belongs (see the module's docstring), registered."""
    if device == "gpu":
        from elastic_emb.tables.gpu import GpuTable

        table: Table = GpuTable(config)
    elif device == "cpu":
        connected = connection()
        table = make_local_table(config) if connected is None else connected.make_table(config)
    else:
        raise ValueError(f'`device` must be "cpu" or "gpu". Received: device={device!r}')
    with LOCK:
        _tables[table.name] = table
    return table


def registered_tables() -> dict[str, Table]:
    """The live tables of this process, by name."""
    with LOCK:
        return dict(_tables.items())


def unregister(table: Table) -> None:
    """Removes `table` from the registry (its name becomes free)."""
    with LOCK:
        if _tables.get(table.name) is table:
            del _tables[table.name]


def connection() -> Connection | None:
    """The connection new tables go to (connecting from the environment once), or None."""
    global _from_environment
    with LOCK:
        hook, _from_environment = _from_environment, None
        if hook is not None:
            hook()
        return _connection


def current_cluster() -> Any:
    """The cluster new tables go to, or None (in-process)."""
    connected = connection()
    return None if connected is None else connected.cluster


def connect(new: Connection) -> None:
    """Later tables go to `new.cluster` (`ee.init`)."""
    global _connection, _from_environment
    with LOCK:
        if _connection is not None:
            raise ValueError(
                f"elastic_emb is already connected to {_connection.cluster.addresses}; "
                "call ee.shutdown() first"
            )
        _connection, _from_environment = new, None


def disconnect() -> Connection | None:
    """Later tables are in-process; the tables of the connection leave the registry."""
    global _connection
    with LOCK:
        old, _connection = _connection, None
        if old is not None:
            for name, table in list(_tables.items()):
                if table.cluster is old.cluster:
                    del _tables[name]
        return old


def connect_from_environment(hook: Callable[[], None] | None) -> None:
    """Sets what `connection()` runs once first (None: nothing): `ee.init()` from the
    environment's ELASTIC_EMB_PS / ELASTIC_EMB_COORDINATOR."""
    global _from_environment
    with LOCK:
        _from_environment = hook


table_module._Placed.create = create_table
