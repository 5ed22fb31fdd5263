"""The model: one transformer with a pluggable query (nlq.model.query.QUERIES).

The names below load on first use (PEP 562), so `import nlq.model.query` (which config
validation does to read the registry) does not import the transformer and, through it,
nlq.config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nlq.model.query import QUERIES, make_query
    from nlq.model.transformer import Attention, Block, Transformer, prefix_lm_mask

__all__ = ["QUERIES", "Attention", "Block", "Transformer", "make_query", "prefix_lm_mask"]


def __getattr__(name: str):
    if name in ("QUERIES", "make_query"):
        from nlq.model import query

        return getattr(query, name)
    if name in ("Attention", "Block", "Transformer", "prefix_lm_mask"):
        from nlq.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'nlq.model' has no attribute {name!r}")
