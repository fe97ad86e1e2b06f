"""The policies a table runs: optimizers and initializers (Keras formulas, converted from
Keras objects), admission, eviction and storage (checked arguments)."""
