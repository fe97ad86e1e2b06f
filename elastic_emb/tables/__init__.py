"""Embedding tables: the `Table` interface (`table`) and its in-process kinds (`local`,
`gpu`, `tiered`), keys to slots (`sharding`), rows in compact dtypes (`rows`), the
policies a table runs (`policies`), and where `Table(...)` puts a new table and the
tables by name (`registry`). Imports nothing of elastic_emb above it (no TensorFlow,
Keras or gRPC).
"""

# `Table(...)` asks the registry where a new table lives.
from elastic_emb.tables import registry as _registry  # noqa: F401
