"""Exact parameter counts, and the MLP width that grows a model by +P% non-embedding params.

Counts come from the real modules built on the meta device (no memory, no init cost), so
they can never drift from the model code: a model of one block, plus n_layer - 1 more of its
block (every block has the same parameters). So a count takes milliseconds whatever the
size: `nlq params --set model.n_layer=100000` answers at once.
"""

from __future__ import annotations

import dataclasses

import torch

from nlq.model.config import ModelConfig
from nlq.model.transformer import Transformer


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, non-embedding) parameters; a tied matrix counts once."""
    with torch.device("meta"):
        m = Transformer(dataclasses.replace(cfg, n_layer=1), seed=0)
    more = (cfg.n_layer - 1) * sum(p.numel() for p in m.blocks[0].parameters())
    return m.num_params() + more, m.num_params(non_embedding=True) + more


def mlp_width_for_pct(cfg: ModelConfig, pct: float) -> int:
    """The MLP width whose non-embedding count comes closest to (1 + pct/100) times cfg's.
    For GPT-3 small and +12.5% this gives the paper's 4.75d = 3648 (+12.497%)."""
    h0 = cfg.mlp_width
    n0 = count_params(cfg)[1]
    n1 = count_params(dataclasses.replace(cfg, mlp_hidden=h0 + 1))[1]
    per_unit = n1 - n0  # the count is linear in the width: 2 d per layer (+1 with bias)
    target = n0 * (1.0 + pct / 100.0)
    return max(1, h0 + round((target - n0) / per_unit))


def pct_vs(n: int, base: int) -> float:
    return 100.0 * (n - base) / base


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6 N for the matmul weights (forward + backward; N excludes the
    position table and an untied token table, lookups both, and counts a tied token table
    once, as the output head) plus 12 L d T for attention scores and values (Kaplan et al.
    2020; PaLM app. B)."""
    n = count_params(cfg)[0] - (cfg.block_size * cfg.d_model if cfg.pos_emb == "learned" else 0)
    if not cfg.tie_embeddings:  # the input table is a lookup; lm_head is the matmul
        n -= cfg.vocab_size * cfg.d_model
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * cfg.block_size
