"""A query variant of your own, trained by the nlq CLI.

    nlq --import examples/own_query.py train tiny --set model.query='"gated"'

The module registers the variant; `--import` makes `nlq train`, and every run that
`nlq sweep` / `nlq reproduce` start, import it before reading the config.
"""

import torch
from torch import nn

from nlq.model.query import register_query


class GatedQuery(nn.Module):
    """Q = X * sigmoid(X W_g): the identity query, gated per feature (d^2 parameters)."""

    scale_factor = 1.0  # no change to the attention's logit scale

    def __init__(self, cfg):  # cfg: nlq.config.ModelConfig
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return x * torch.sigmoid(self.gate(x))


register_query("gated", GatedQuery)
