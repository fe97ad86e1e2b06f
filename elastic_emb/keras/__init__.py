"""The Keras face of elastic_emb: the `ee.Embedding` layer (`layers`), the lookup path
every layer shares (`lookup`), `ee.DistributedEmbedding` (`multi_feature`), callbacks,
dense weights on the PS (`dense_ps`), mixed precision (`loss_scaling`), a model's
export (`models`) and every use of Keras beyond its public API (`patches`).

Needs TensorFlow with Keras 3; never imports gRPC or `elastic_emb.ps` (remote
tables reach it through the `ee.Table` interface). Importing this package
installs the hooks into Keras's model methods, once, here.
"""

from elastic_emb.keras import models as _models

_models.install_hooks()
