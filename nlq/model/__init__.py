from nlq.model.query import QUERIES, make_query
from nlq.model.transformer import Attention, Block, Transformer, prefix_lm_mask

__all__ = ["QUERIES", "make_query", "Attention", "Block", "Transformer", "prefix_lm_mask"]
