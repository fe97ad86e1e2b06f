"""The Keras face of elastic_emb: the `ee.Embedding` layer (`base`, what every backend
shares; `layers`, TensorFlow; `on_jax`, JAX, with `jax_ids` for int64 ids without
64-bit types), the lookup path TensorFlow layers share
(`lookup`), `ee.DistributedEmbedding` (`multi_feature`), callbacks, dense weights on
the PS (`dense_ps`), mixed precision (`loss_scaling`), a model's export (`models`) and
every use of Keras beyond its public API (`patches`).

Never imports gRPC or `elastic_emb.ps` (remote tables reach it through the `ee.Table`
interface). On Keras' TensorFlow backend, importing this package installs the hooks
into Keras's model methods, once, here; on JAX it imports neither TensorFlow nor them.
"""

import keras

if keras.backend.backend() == "tensorflow":
    from elastic_emb.keras import models as _models

    _models.install_hooks()
