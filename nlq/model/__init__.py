"""The model, the ground floor of nlq: one transformer with a pluggable query.

- config.py: ModelConfig (the [model] keys) and its checks;
- layers.py, query.py: norms and activations by name; the query modules and their registry
  (QUERIES, register_query, check_query);
- transformer.py: attention, blocks, the Transformer (init, weights on disk);
- loss.py, generate.py, params.py: the chunked loss, sampling, parameter counts;
- kernels.py, fast.py: CPU kernels of the same math, applied from outside by
  apply_fast_paths (the training set-up does).
Nothing here imports the rest of nlq (config, data, train, eval, experiments, infer):
tests/test_imports.py checks it.
"""

from nlq.model.config import ModelConfig
from nlq.model.fast import apply_fast_paths
from nlq.model.query import QUERIES, make_query, register_query
from nlq.model.transformer import Attention, Block, Transformer, prefix_lm_mask

__all__ = ["QUERIES", "Attention", "Block", "ModelConfig", "Transformer", "apply_fast_paths",
           "make_query", "prefix_lm_mask", "register_query"]
