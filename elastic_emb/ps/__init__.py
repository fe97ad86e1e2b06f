"""The distributed parts: parameter-server shards and their clients (gRPC).

Client side: `client.ShardClient` (channels, calls, deadlines, retries,
errors, traffic stats), `cluster.Cluster` (a worker's step protocol: fused
pulls and pushes, step counting, background pushes) and
`remote_table.RemoteTable` (the `Table` interface over a cluster). Server
side: `server.serve` (the process), `servicer.Servicer` (the gRPC service)
and `shard.Shard` (the tables and the training mode). `protocol` holds every
conversion between messages and numpy. `ee.init` (in `elastic_emb.placement`)
connects a process; nothing here is imported before that, and this package
itself imports nothing.
"""
