"""Warning and error classes shared by the modules of elastic_emb."""

from __future__ import annotations

__all__ = ["ElasticEmbWarning", "ModeMismatchError"]


class ElasticEmbWarning(UserWarning):
    """Warnings issued by elastic_emb."""


class ModeMismatchError(ValueError):
    """`ee.init` asked for another training mode than the job's.

    A job's mode ("sync", "async", an async staleness bound; without a
    coordinator also its number of workers) is fixed by its first worker's
    `ee.init` and holds as long as its servers (with a coordinator: its
    etcd) do. The message says which mode the job runs in and how to start
    a new one.
    """
