"""Keras callbacks: save tables and dense weights together, and resume; log what the
tables cost."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import keras

from elastic_emb.keras.base import embedding_layers
from elastic_emb.keras_range import require
from elastic_emb.persistence import checkpoint
from elastic_emb.tables import registry

__all__ = ["Checkpoint", "Metrics"]

_LATEST = "latest"


class Checkpoint(keras.callbacks.Callback):
    """Saves every table and the model's weights (optimizer state included), and resumes.

    Each save writes `directory/ckpt-<step>/` with the tables (`ee.save`),
    `model.weights.h5` (dense weights and the compile optimizer's variables)
    and `state.json`, then atomically points `directory/latest` at it. At the
    start of `fit`, if `directory/latest` exists, everything is restored and
    training continues from the saved epoch. With epoch-end checkpoints and
    an input pipeline that yields the same batches in a new process, an
    interrupted run finishes with exactly the model of an uninterrupted one.
    As with `keras.callbacks.BackupAndRestore`, a checkpoint taken mid-epoch
    resumes at the start of that epoch (its first batches train again).

    With `incremental=True`, each checkpoint's `tables/` starts as a copy of
    the previous checkpoint's (hard links: no bytes copied) and gets one delta
    of the rows changed since (`ee.save(..., incremental=True)`), so every
    checkpoint is complete on its own while only changes are written.

    Example:
        >>> cb = Checkpoint("/tmp/run1", save_freq="epoch")
        >>> model.fit(ds, epochs=10, callbacks=[cb])  # doctest: +SKIP

    Args:
        directory: str or path of the checkpoint directory.
        save_freq: "epoch", or an int: save every that many training batches.
        max_to_keep: int, number of newest checkpoints kept on disk.
        resume: bool, restore from `directory/latest` when training starts.
        incremental: bool, write the tables as deltas (in-process CPU tables).
        max_deltas: int >= 0, with `incremental`, the most deltas before a
            checkpoint writes its tables in full again.

    Raises:
        ValueError: on an invalid argument.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        save_freq: str | int = "epoch",
        max_to_keep: int = 2,
        resume: bool = True,
        incremental: bool = False,
        max_deltas: int = checkpoint.DEFAULT_MAX_DELTAS,
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq <= 0
        ):
            raise ValueError(
                f'`save_freq` must be "epoch" or a positive int. Received: save_freq={save_freq!r}'
            )
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(
                f"`max_to_keep` must be a positive int. Received: max_to_keep={max_to_keep!r}"
            )
        checkpoint.check_incremental(incremental, max_deltas)
        self.directory = Path(directory)
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.resume = resume
        self.incremental = incremental
        self.max_deltas = max_deltas
        self._epoch = 0
        self._global_step = 0
        self._batches_since_save = 0

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        pointer = self.directory / _LATEST
        if not pointer.is_file():
            return None
        path = self.directory / pointer.read_text().strip()
        if not (path / "state.json").is_file():
            raise checkpoint.CheckpointError(
                f"{pointer} names {path.name}, which is not a complete checkpoint"
            )
        return path

    def on_train_begin(self, logs: Any = None) -> None:
        cluster = registry.current_cluster()
        if cluster is not None and cluster.num_workers > 1:
            # Every worker would write (and on resume, restore) the shared tables.
            raise ValueError(
                "ee.callbacks.Checkpoint supports one worker; with "
                f"{cluster.num_workers} workers, call ee.save(...) from worker 0 between epochs "
                "(see docs/distributed.md)"
            )
        path = self.latest() if self.resume else None
        if path is None:
            return
        state = json.loads((path / "state.json").read_text())
        checkpoint.restore(path / "tables", tables=self._tables())
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        self.model.load_weights(path / "model.weights.h5")
        self._epoch = state["epoch"]
        self._global_step = state["global_step"]
        # The same hook keras.callbacks.BackupAndRestore uses to skip epochs.
        require(hasattr(self.model, "_initial_epoch"), "Model._initial_epoch", "resuming fit")
        self.model._initial_epoch = self._epoch

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._global_step += 1
        self._batches_since_save += 1
        if isinstance(self.save_freq, int) and self._batches_since_save >= self.save_freq:
            # Mid-epoch: resuming restarts this epoch.
            self.save(epoch=self._epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.save_freq == "epoch":
            self.save(epoch=epoch + 1)

    def save(self, epoch: int) -> Path:
        """Writes a checkpoint now; `epoch` is the epoch training resumes at."""
        self._batches_since_save = 0
        name = f"ckpt-{self._global_step}"
        tmp = self.directory / (name + ".tmp")
        final = self.directory / name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.incremental:
            self._save_incremental(tmp / "tables")
        else:
            checkpoint.save(tmp / "tables", tables=self._tables())
        self.model.save_weights(tmp / "model.weights.h5")
        state = {"epoch": epoch, "global_step": self._global_step}
        (tmp / "state.json").write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer_tmp = self.directory / (_LATEST + ".tmp")
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, self.directory / _LATEST)
        self._prune(keep=final)
        return final

    def _save_incremental(self, tables_dir: Path) -> None:
        """The tables as the previous checkpoint's chains plus one delta each."""
        try:
            previous = self.latest()
            if previous is not None:
                checkpoint.clone(previous / "tables", tables_dir)
        except (checkpoint.CheckpointError, OSError):
            # No usable previous checkpoint: the save writes bases.
            shutil.rmtree(tables_dir, ignore_errors=True)
        checkpoint.save(
            tables_dir, tables=self._tables(), incremental=True, max_deltas=self.max_deltas
        )

    def _tables(self) -> list[Any]:
        return _tables(self.model)

    def _prune(self, keep: Path) -> None:
        def step(p: Path) -> int:
            return int(p.name.split("-")[1])

        saved = sorted(
            (p for p in self.directory.glob("ckpt-*") if p.is_dir() and p.suffix != ".tmp"),
            key=step,
        )
        for old in saved[: max(0, len(saved) - self.max_to_keep)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)


class Metrics(keras.callbacks.Callback):
    """Logs what the model's embedding tables cost: rows, and for remote tables the
    bytes on the wire and the pull and push time per training step.

    At the end of each epoch it adds to the Keras logs (so `History`,
    `CSVLogger` and a `TensorBoard` callback listed after it record them):

    - `ee_rows`: rows of the model's `ee.Embedding` tables;
    - `ee_bytes_per_step`: bytes sent and received per step, over the epoch
      (remote tables; 0 in-process);
    - `ee_pull_ms`, `ee_push_ms`: milliseconds per step of the pull and the
      push round over the shards (remote tables). A push overlaps the next
      step, so its time is not all on the step's critical path;
    - `ee_cache_hit_rate` (with `ee.init(cache_rows=...)`): the share of
      pulled keys whose values did not cross the wire (served by the cache,
      or confirmed unchanged).

    With `log_dir`, it also writes these as TensorBoard scalars every
    `every` steps (`tf.summary`, under `log_dir/ee`).

    Args:
        log_dir: str or None, a TensorBoard log directory.
        every: int >= 1, steps between TensorBoard points.
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, every: int = 100) -> None:
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"`every` must be a positive integer. Received: every={every!r}")
        if log_dir is not None and keras.backend.backend() != "tensorflow":
            raise ValueError(
                "ee.callbacks.Metrics(log_dir=...) writes TensorBoard scalars with tf.summary, "
                f"which needs Keras' TensorFlow backend (this is {keras.backend.backend()!r}). "
                "Leave log_dir out: the values still go to the epoch's logs (the History "
                "model.fit returns, keras.callbacks.CSVLogger)."
            )
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.every = every
        self._writer: Any = None
        self._step = 0
        self._epoch_start: dict[str, float] = {}
        self._point_start: dict[str, float] = {}

    def _counts(self) -> dict[str, float]:
        """Totals so far: steps, bytes, pulls and pushes and their seconds."""
        cluster = registry.current_cluster()
        counts = {"steps": float(self._step)}
        if cluster is None:
            return counts
        stats = cluster.stats()
        counts["bytes"] = float(sum(s["bytes_sent"] + s["bytes_received"] for s in stats))
        counts.update(cluster.timings())
        if cluster.cache is not None:
            cache = cluster.cache.counts()
            for kind in ("served", "confirmed", "fetched"):
                counts[f"cache_{kind}"] = float(cache[kind])
        return counts

    def _values(self, start: dict[str, float]) -> dict[str, float]:
        """The logged values since the totals `start`."""
        now = self._counts()
        steps = max(now["steps"] - start["steps"], 1.0)

        def per_step(key: str, scale: float = 1.0) -> float:
            return scale * (now.get(key, 0.0) - start.get(key, 0.0)) / steps

        rows = sum(len(t) for t in _tables(self.model))
        values = {
            "ee_rows": float(rows),
            "ee_bytes_per_step": per_step("bytes"),
            "ee_pull_ms": per_step("pull_seconds", 1000.0),
            "ee_push_ms": per_step("push_seconds", 1000.0),
        }
        if "cache_served" in now:  # a worker cache: the share of pulled keys it answered
            kinds = [per_step(f"cache_{k}") for k in ("served", "confirmed", "fetched")]
            values["ee_cache_hit_rate"] = (kinds[0] + kinds[1]) / max(sum(kinds), 1e-12)
        return values

    def on_train_begin(self, logs: Any = None) -> None:
        if self.log_dir is not None and self._writer is None:
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(str(self.log_dir / "ee"))
        self._point_start = self._counts()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch_start = self._counts()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._step += 1
        if self._writer is None or self._step % self.every:
            return
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2

        values = self._values(self._point_start)
        self._point_start = self._counts()
        # What tf.summary.scalar writes, without needing the tensorboard package.
        scalar = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
        )
        with self._writer.as_default(step=self._step):
            for name, value in values.items():
                tf.summary.write(name, tf.constant(value, tf.float32), metadata=scalar)
        self._writer.flush()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs.update(self._values(self._epoch_start))

    def on_train_end(self, logs: Any = None) -> None:
        if self._writer is not None:
            self._writer.flush()


def _tables(model: Any) -> list[Any]:
    """The tables of `model`'s elastic_emb layers."""
    return [layer.table for layer in embedding_layers(model)]
