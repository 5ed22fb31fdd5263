"""A query variant of your own, trained by the nlq CLI.

    nlq --import examples/own_query.py train tiny --set model.query='"gated"'
    nlq --import examples/own_query.py train tiny --set model.query='"gated"' \
        --set model.query_args.rank=16

The module registers the variant; `--import` makes `nlq train`, and every run that
`nlq sweep` / `nlq reproduce` start, import it before reading the config. The variant's own
settings come from the config's [model.query_args] table (or `--set model.query_args.NAME=`)
as keyword arguments after cfg; a name __init__ does not take is an error when the config
loads.
"""

import torch
from torch import nn

from nlq.model.query import register_query


class GatedQuery(nn.Module):
    """Q = X * sigmoid(X W_g): the identity query, gated per feature. W_g is C x C (d^2
    parameters), or with [model.query_args] rank = r the low-rank C x r times r x C (2 d r)."""

    scale_factor = 1.0  # no change to the attention's logit scale

    def __init__(self, cfg, *, rank: int | None = None):  # cfg: nlq.config.ModelConfig
        super().__init__()
        C = cfg.d_model
        if rank is None:
            self.gate = nn.Linear(C, C, bias=cfg.bias)
        else:
            self.gate = nn.Sequential(nn.Linear(C, rank, bias=False),
                                      nn.Linear(rank, C, bias=cfg.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return x * torch.sigmoid(self.gate(x))


register_query("gated", GatedQuery)
