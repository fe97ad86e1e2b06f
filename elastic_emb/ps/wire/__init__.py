"""The wire: every conversion between gRPC messages and NumPy (`protocol`), and the
transport's security, roles and channel options (`security`). Used by both ends."""
