"""Warning and error classes shared by the modules of elastic_emb."""

from __future__ import annotations

__all__ = ["ElasticEmbWarning"]


class ElasticEmbWarning(UserWarning):
    """Warnings issued by elastic_emb."""
