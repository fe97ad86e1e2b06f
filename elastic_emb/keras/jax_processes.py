"""Several JAX processes (`jax.distributed.initialize`, `keras.distribution.DataParallel`):
each process is one elastic_emb worker, pulling and pushing the rows of its own part of
the global batch, once per step.

In a jitted program over several processes, a plain `io_callback` runs once, on the
first device, with the whole global batch: process 0 alone would reach the tables. So
with several processes the layer's callbacks run in a `shard_map` over the
distribution's devices. Each device holds its block of the batch; the blocks of a
process's other devices go to its first device (`ppermute`, inside the process), whose
callback pulls (pushes) them all, and the rows go back the same way.

Each process pushes the gradient of its part of the batch. The loss is a mean over the
global batch, so that gradient already carries 1 / (global batch), and a sync step sums
the pushes of all workers: the step one process takes with the whole global batch (as
the workers of TensorFlow's MultiWorkerMirroredStrategy do). Neither TensorFlow nor
`elastic_emb.keras.layers` is imported here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh, PartitionSpec

__all__ = ["host_callback"]


def host_callback(
    layer_name: str,
    cluster: Any,
    callback: Callable[..., np.ndarray],
    result: jax.ShapeDtypeStruct,
    *args: Any,
    summed: bool = False,
) -> Any:
    """`io_callback(callback, result, *args, ordered=True)`, run once per process.

    `args` are batch-major (all of length n). `result` is `(n, ...)` (rows: each device
    gets its block), or with `summed` any shape (a push's trigger gradient: summed over
    the processes). In one process, the plain ordered `io_callback`. `cluster`: the
    table's (None: in-process). Called outside a jitted step (a layer called on
    concrete ids), the ids are this process's own: the plain callback too."""
    if jax.process_count() == 1 or not isinstance(args[0], jax.core.Tracer):
        return io_callback(callback, result, *args, ordered=True)
    mesh, axis = _data_parallel_mesh(layer_name, cluster)
    devices = mesh.devices.size
    n = args[0].shape[0]
    if n % devices:
        raise ValueError(
            f"elastic_emb.Embedding {layer_name!r} over several JAX processes needs its ids "
            f"to split evenly over the {devices} devices of the distribution (a global batch "
            f"divisible by {devices}). Received: {n} ids"
        )
    block = n // devices
    groups = _devices_by_process(mesh)
    local = len(groups[0])
    rank_of = np.zeros(devices, np.int32)  # each mesh position's rank in its process
    for group in groups:
        rank_of[group] = np.arange(local, dtype=np.int32)
    batch_result = not summed
    local_result = jax.ShapeDtypeStruct(
        (local * block, *result.shape[1:]) if batch_result else result.shape, result.dtype
    )

    def on_device(*blocks: Any) -> Any:
        rank = jnp.asarray(rank_of)[jax.lax.axis_index(axis)]
        # The process's blocks on its first device, in rank order.
        gathered = [
            jnp.concatenate(
                [x]
                + [
                    jax.lax.ppermute(x, axis, [(g[j], g[0]) for g in groups])
                    for j in range(1, local)
                ]
            )
            for x in blocks
        ]
        if local == 1:
            out = io_callback(callback, local_result, *gathered, ordered=True)
        else:
            out = jax.lax.cond(
                rank == 0,
                lambda *xs: io_callback(callback, local_result, *xs, ordered=True),
                lambda *xs: jnp.zeros(local_result.shape, local_result.dtype),
                *gathered,
            )
        if not batch_result:
            return out
        mine = out[:block]
        for j in range(1, local):
            sent = jax.lax.ppermute(
                out[j * block : (j + 1) * block], axis, [(g[0], g[j]) for g in groups]
            )
            mine = jnp.where(rank == j, sent, mine)
        return mine

    spec = PartitionSpec(axis)
    per_device = _shard_map(on_device, mesh, tuple(spec for _ in args), spec)(*args)
    if batch_result:
        return per_device
    return jnp.sum(jnp.reshape(per_device, (devices, *result.shape)), axis=0)


def _data_parallel_mesh(layer_name: str, cluster: Any) -> tuple[Mesh, str]:
    """The JAX mesh of Keras's DataParallel distribution, and its batch axis; raises
    where several processes cannot train as one."""
    if cluster is None:
        raise ValueError(
            f"elastic_emb.Embedding {layer_name!r} runs in {jax.process_count()} JAX processes "
            "with an in-process table: each process would train its own copy on its part of "
            "the batch. Put the tables on parameter servers: ee.init(ps=[...], mode='sync') in "
            "every process, after jax.distributed.initialize (docs/jax.md#several-processes)."
        )
    if (
        cluster.mode == "sync"
        and cluster.routing is None
        and cluster.num_workers != jax.process_count()
    ):
        raise ValueError(
            f"elastic_emb.Embedding {layer_name!r} runs in {jax.process_count()} JAX "
            f"processes, but the sync job has num_workers={cluster.num_workers}: each process "
            "is one worker. Call jax.distributed.initialize before ee.init (the workers are "
            "then the processes), or pass ee.init(worker_index=jax.process_index(), "
            "num_workers=jax.process_count())."
        )
    if jax.default_backend() == "cpu" and _cpu_collectives() in (None, "none"):
        raise ValueError(
            f"elastic_emb.Embedding {layer_name!r} runs in {jax.process_count()} JAX processes "
            "on CPUs without cross-process collectives. Call "
            'jax.config.update("jax_cpu_collectives_implementation", "gloo") before '
            "jax.distributed.initialize."
        )
    distribution = keras.distribution.distribution()
    mesh = getattr(distribution, "device_mesh", None)
    if not isinstance(distribution, keras.distribution.DataParallel) or mesh is None:
        raise ValueError(
            f"elastic_emb.Embedding {layer_name!r} runs in {jax.process_count()} JAX processes "
            "without a data-parallel distribution. Call "
            "keras.distribution.set_distribution(keras.distribution.DataParallel()) in every "
            f"process before building the model. Received: distribution={distribution!r}"
        )
    by_name = {f"{d.platform}:{d.id}": d for d in jax.devices()}
    devices = [d if isinstance(d, jax.Device) else by_name[str(d)] for d in mesh.devices.flat]
    (axis,) = mesh.axis_names  # (DataParallel's mesh: the batch axis only)
    return Mesh(np.array(devices), (axis,)), axis


def _cpu_collectives() -> str | None:
    """`jax_cpu_collectives_implementation` ("none" by default in older JAX, "gloo" in newer)."""
    try:
        return str(jax.config.read("jax_cpu_collectives_implementation"))
    except AttributeError:  # (newer JAX reads options with a context manager this way)
        return getattr(jax.config, "jax_cpu_collectives_implementation", None)


def _devices_by_process(mesh: Mesh) -> list[list[int]]:
    """Mesh positions grouped by process (each in mesh order); every process has as many."""
    groups: dict[int, list[int]] = {}
    for position, device in enumerate(mesh.devices.flat):
        groups.setdefault(device.process_index, []).append(position)
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1:
        raise ValueError(
            "elastic_emb.Embedding over several JAX processes needs as many devices in each "
            f"process. Received: { ({p: len(g) for p, g in groups.items()}) }"
        )
    return list(groups.values())


def _shard_map(f: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any) -> Any:
    """`jax.shard_map` without replication checks (`jax.experimental.shard_map` before it)."""
    public = getattr(jax, "shard_map", None)
    if public is not None and "check_vma" in inspect.signature(public).parameters:
        return public(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(f, mesh, in_specs, out_specs, check_rep=False)
