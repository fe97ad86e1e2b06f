"""A worker's side of the PS: `cluster.Cluster` (the step protocol, over a range router,
a step fuser, the push queue and read-ahead), `remote_table.RemoteTable` (the `Table`
interface over it), `routing` (a coordinator's map), `row_cache`, `shard_client`."""
