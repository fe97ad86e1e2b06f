"""Demo, benchmark and test support: not the library itself.

`criteo` (Criteo-format data: a generator with a planted signal, a parser,
tf.data; also `ee.data`), `dlrm` (the DLRM-style model) and `demo` (the
`elastic-emb demo` command). They use the library as a user would.
"""
