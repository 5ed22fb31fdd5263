"""Query modules: the one swappable part of attention.

Legend: B batch, T time, C = d_model, r = nl_rank.
Each module maps the block's pre-attention normalised input x (B, T, C) to the query
(B, T, C) and exposes `scale_factor`, a constant the attention multiplies into its logit
scale (1 except for the folded nonlinear query). Keys and values are not here: they are
`attn.k_proj` / `attn.v_proj` in every variant, so their weights move between variants.
A new variant is a new class registered in QUERIES: config validation (model.query) and
the tests that loop over variants read the registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nlq.model import kernels
from nlq.model.layers import ACTIVATIONS, RMSNorm, make_norm

if TYPE_CHECKING:  # the modules read cfg's fields; importing nlq.config here would be a cycle
    from nlq.config import ModelConfig


class LinearQuery(nn.Module):
    """Q = X W_Q: the standard projection (d^2 parameters)."""

    scale_factor = 1.0

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class IdentityQuery(nn.Module):
    """Q = X: W_Q = I, no parameters (Karbevski & Mijoski, arXiv 2510.23912)."""

    scale_factor = 1.0

    def __init__(self, cfg: ModelConfig):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ResidualQuery(nn.Module):
    """Q = X + X W_Q: a linear residual, same parameter count as linear."""

    scale_factor = 1.0

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class NonlinearQuery(nn.Module):
    """Q = (X + f(X)) / 2,  f(X) = LN(GELU(RMSNorm(X) W1) W2)  (Karbevski 2026; docs/paper.md,
    "The nonlinear query").

    W1: C x r, W2: r x C with r = C/2 by default, so f has C^2 weights plus two norm gains.
    The identity term anchors f to the known-good identity query. With nl_half = "fold"
    forward returns X + f(X) and the 1/2 moves into the attention scale (scale_factor = 0.5),
    as the official code does (scale 1/(2 sqrt(hs))); "explicit" returns (X + f(X)) / 2.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.in_norm = make_norm(cfg.nl_in_norm, cfg.d_model, cfg.bias, cfg.norm_eps)
        self.w1 = nn.Linear(cfg.d_model, cfg.rank, bias=cfg.bias)
        self.act = ACTIVATIONS[cfg.nl_act]()
        self.w2 = nn.Linear(cfg.rank, cfg.d_model, bias=cfg.bias)
        # The output norm starts at weight 1, bias 0 (nn defaults): f(X) has zero mean and
        # unit variance per token at init, on the scale of the normalised X (docs/paper.md,
        # "The nonlinear query").
        self.out_norm = make_norm(cfg.nl_out_norm, cfg.d_model, cfg.bias, cfg.norm_eps)
        self.explicit_half = cfg.nl_half == "explicit"
        self.scale_factor = 1.0 if self.explicit_half else 0.5

    def f(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(self.in_norm(x))  # (B, T, r)
        return self.out_norm(self.w2(self.act(h)))

    def fused_cpu(self, x: torch.Tensor) -> bool:
        """Whether forward takes kernels.NonlinearQueryCPU: the paper's f (RMSNorm in, GELU,
        LayerNorm out, no biases) on CPU in fp32/fp64 without autocast, kernels enabled.
        Everything else (GPU, autocast, biases, other norms or activations) runs f."""
        return (kernels.enabled() and isinstance(self.in_norm, RMSNorm)
                and isinstance(self.out_norm, nn.LayerNorm) and isinstance(self.act, nn.GELU)
                and self.w1.bias is None and self.w2.bias is None
                and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
                and x.dtype == self.w1.weight.dtype == self.in_norm.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_cpu(x):
            q = kernels.NonlinearQueryCPU.apply(
                x, self.in_norm.weight, self.w1.weight, self.w2.weight, self.out_norm.weight,
                self.out_norm.bias, self.in_norm.eps, self.out_norm.eps, self.act.approximate)
        else:
            q = x + self.f(x)
        return 0.5 * q if self.explicit_half else q


QUERIES: dict[str, type[nn.Module]] = {
    "linear": LinearQuery,
    "identity": IdentityQuery,
    "residual": ResidualQuery,
    "nonlinear": NonlinearQuery,
}


def make_query(cfg: ModelConfig) -> nn.Module:
    return QUERIES[cfg.query](cfg)
