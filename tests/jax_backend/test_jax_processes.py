"""Several JAX processes in sync data parallelism (`jax.distributed`, DataParallel), each an
elastic_emb worker on real `elastic-emb serve` shards: they train as one process with the
global batch."""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
from _cluster import shards
from _process_worker import LOCAL_BATCH, STEPS, global_batches
from _small_model import small_model, sorted_rows

WORKER = Path(__file__).with_name("_process_worker.py")
PROCESSES = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_processes(ps: str, out: Path, devices_each: int) -> None:
    """Runs the JAX processes of _process_worker.py to the end (all killed after 120 s, or
    once one fails)."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_each}",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [out.with_name(f"process_{i}.log") for i in range(PROCESSES)]
    procs = []
    for i, log in enumerate(logs):
        with log.open("w") as sink:  # (a file, never a full pipe)
            command = [sys.executable, str(WORKER), str(i), str(PROCESSES), coordinator, ps]
            procs.append(
                subprocess.Popen(
                    [*command, str(out)], env=env, stdout=sink, stderr=subprocess.STDOUT
                )
            )
    deadline = time.monotonic() + 120
    try:  # (one process failing leaves the others waiting for it: stop at the first)
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() for p in procs):
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log.read_text()[-4000:]


@pytest.mark.skipif(
    "auto_shard_dataset" not in inspect.signature(keras.distribution.DataParallel).parameters,
    reason=f"Keras {keras.__version__} takes only a tf.data.Dataset (TensorFlow) in several "
    "processes; DataParallel(auto_shard_dataset=False) takes arrays (keras-team/keras#21430)",
)
def test_two_processes_train_as_one_process_with_the_global_batch(tmp_path):
    out = tmp_path / "processes.npz"
    with shards(2) as ps:  # two devices each: a process's callback takes both devices' ids
        _run_processes(",".join(s.address for s in ps), out, devices_each=2)
    got = np.load(out)
    # Each process pulls each table and pushes once per step, on each shard.
    steps = 2 * STEPS
    assert got["Pull"].tolist() == [2 * PROCESSES * steps] * 2
    assert got["Push"].tolist() == [PROCESSES * steps] * 2

    # One process, in-process tables, the global batches.
    x, y = global_batches(PROCESSES)
    model = small_model("jax_procs")
    history = model.fit(
        x, y, batch_size=LOCAL_BATCH * PROCESSES, epochs=2, shuffle=False, verbose=0
    )

    np.testing.assert_allclose(got["loss"], history.history["loss"], rtol=1e-5)
    for name in ("jax_procs_a", "jax_procs_b"):
        table = model.get_layer(name).table
        assert got[f"{name}_iterations"] == table.iterations == steps
        keys, rows = sorted_rows(table)
        np.testing.assert_array_equal(got[f"{name}_keys"], keys)
        np.testing.assert_allclose(got[f"{name}_rows"], rows, rtol=1e-5, atol=1e-6)
    for i, weight in enumerate(model.layers[-1].get_weights()):
        np.testing.assert_allclose(got[f"dense_{i}"], weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["looked_up"], got["jax_procs_a_rows"][:3])


def test_what_cannot_train_as_one_process_is_refused_naming_the_fix(monkeypatch):
    """Checked as the layer's callbacks are traced in each of several processes (here one
    process that JAX says is one of two)."""
    from types import SimpleNamespace

    import jax

    from elastic_emb.keras import jax_processes
    from elastic_emb.keras.jax_processes import _data_parallel_mesh

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"in-process table.*ee.init\(ps="):
        _data_parallel_mesh("t", None)
    one_worker = SimpleNamespace(mode="sync", routing=None, num_workers=1)
    with pytest.raises(ValueError, match=r"num_workers=1.*jax.distributed.initialize before"):
        _data_parallel_mesh("t", one_worker)
    two_workers = SimpleNamespace(mode="sync", routing=None, num_workers=2)
    monkeypatch.setattr(jax_processes, "_cpu_collectives", lambda: "none")  # (JAX 0.5's default)
    with pytest.raises(ValueError, match=r'update\("jax_cpu_collectives_implementation", "gloo"'):
        _data_parallel_mesh("t", two_workers)
    monkeypatch.setattr(jax_processes, "_cpu_collectives", lambda: "gloo")
    with pytest.raises(ValueError, match=r"without a data-parallel.*DataParallel\(\)"):
        _data_parallel_mesh("t", two_workers)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        mesh, axis = _data_parallel_mesh("t", two_workers)
    finally:
        keras.distribution.set_distribution(None)
    assert list(mesh.devices) == jax.devices() and mesh.axis_names == (axis,)
