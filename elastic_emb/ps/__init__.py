"""The distributed parts: parameter-server shards and their clients (gRPC).

`wire/` holds every conversion between messages and NumPy (`protocol`) and
the transport's security and options (`security`); `coord/` the coordination
through etcd (the cluster map, load, a local cluster); `server/` the shard
process (`server.serve`, the gRPC `servicer`, a range's `shard`, the
`replication` of a coordinated cluster); `client/` a worker's side
(`cluster.Cluster`, `remote_table.RemoteTable`, `routing`, `row_cache`).
`ee.init` (in `elastic_emb.placement`) connects a process; nothing here is
imported before that, and this package itself imports nothing.
"""
