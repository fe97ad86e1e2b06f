"""Export with stock TensorFlow ops: a table as variables a SavedModel serves (`export`),
and deltas between exported versions (`delta`). Takes layers as `export.Servable`s; never
imports the Keras package or gRPC."""
