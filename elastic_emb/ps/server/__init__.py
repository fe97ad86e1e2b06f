"""The shard process: `server.serve`, the gRPC `servicer`, a slot range's `shard`, and a
server's place in a coordinated cluster (`replication` and the modules it delegates to).
Never imports TensorFlow, Keras or the client side."""
