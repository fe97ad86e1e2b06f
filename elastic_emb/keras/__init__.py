"""The Keras face of elastic_emb: the `ee.Embedding` layer (`base`, what every backend
shares; `layers`, TensorFlow; `on_jax`, JAX, with `jax_ids` for int64 ids without
64-bit types), the lookup path TensorFlow layers share
(`lookup`), `ee.DistributedEmbedding` (`multi_feature`), callbacks, dense weights on
the PS (`dense_ps_base`, what every backend shares; `dense_ps`, TensorFlow;
`dense_ps_jax`, JAX), mixed precision (`loss_scaling`), a model's export (`models`),
the compile hook (`compile_hook`) and every use of Keras beyond its public API
(`patches`).

Never imports gRPC or `elastic_emb.ps` (remote tables reach it through the `ee.Table`
interface). On Keras' TensorFlow backend, importing this package installs the hooks
into Keras's model methods, once, here; on JAX it imports no TensorFlow and installs
only the compile hook of `dense_ps_jax` (`ee.init(dense="ps")`).
"""

import keras

if keras.backend.backend() == "tensorflow":
    from elastic_emb.keras import models as _models

    _models.install_hooks()
elif keras.backend.backend() == "jax":
    from elastic_emb.keras import dense_ps_jax as _dense_ps_jax

    _dense_ps_jax.install()  # ee.init(dense="ps") on JAX
