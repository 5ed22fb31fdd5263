"""Query modules: the one swappable part of attention.

Legend: B batch, T time, C = d_model, r = nl_rank.
Each module maps the block's pre-attention normalised input x (B, T, C) to the query
(B, T, C) and exposes `scale_factor`, a constant the attention multiplies into its logit
scale (1 except for the folded nonlinear query). Keys and values are not here: they are
`attn.k_proj` / `attn.v_proj` in every variant, so their weights move between variants.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nlq.config import ModelConfig


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, (..., 1); mean(x^2) as one fused
    reduction, ||x||^2 / C."""
    ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1])
    return torch.rsqrt(ms.add_(eps))


class _RMSNormCPU(torch.autograd.Function):
    """y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), with a hand-written backward.

    On CPU (torch 2.13) F.rms_norm runs as a chain of unfused ops whose backward broadcasts
    and reduces through slow paths: fwd+bwd of a (2048, 256) input took ~3.6 ms against
    ~0.3 ms for the fused layer_norm (benchmarks/RESULTS.md), most of the nonlinear query's
    overhead (issue 7). Used by QK-norm and wherever the fold below does not apply; the same
    math in a few in-place passes:
        dx = rstd * (g*w - xhat * mean(g*w * xhat)),   dw = sum over rows of g * xhat.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = _rstd(x, eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x * rstd  # (..., C)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)  # (N, C) -> (C,)
        dx = None
        if ctx.needs_input_grad[0]:
            gw = g * weight
            dot = (gw * xhat).mean(-1, keepdim=True)  # (..., 1)
            dx = torch.addcmul(gw, xhat, dot, value=-1.0).mul_(rstd)
        return dx, dw, None


class _RMSNormLinearCPU(torch.autograd.Function):
    """RMSNorm(x) @ W^T (no bias) computed as rstd * (x @ (W * g)^T), rstd = 1 / rms(x).

    The exact same map with the gain g folded into the (r, C) weight and the per-row 1/rms
    applied to the (N, r) output: no normalised (N, C) copy of x is written, saved or read
    back. On CPU the query's elementwise work is memory-bound, and this removes most of the
    in-norm's passes over (N, C) data (issue 7). With h = rstd * u, u = x (W g)^T:
        du = dh * rstd,  dx = du (W g) - x * rstd^3 / C * sum_j(dh_j u_j),
        d(W g) = du^T x,  dW = d(W g) * g,  dg = sum over rows of d(W g) * W.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, eps: float):
        C = x.shape[-1]
        x2 = x.reshape(-1, C)  # (N, C)
        rstd = _rstd(x2, eps)  # (N, 1)
        wg = w * g  # (r, C)
        u = x2 @ wg.t()  # (N, r)
        ctx.save_for_backward(x2, g, w, wg, rstd, u)
        return (u * rstd).view(*x.shape[:-1], w.shape[0])  # (..., r)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh: torch.Tensor):
        x2, g, w, wg, rstd, u = ctx.saved_tensors
        C = x2.shape[-1]
        dh2 = dh.reshape(-1, w.shape[0])  # (N, r)
        du = dh2 * rstd  # (N, r)
        dx = du @ wg  # (N, C)
        drstd = (dh2 * u).sum(-1, keepdim=True)  # (N, 1)
        dx.addcmul_(x2, drstd.mul_(rstd.pow(3)).div_(-C))
        dwg = du.t() @ x2  # (r, C)
        return dx.view(*dh.shape[:-1], C), (dwg * w).sum(0), dwg * g, None


class RMSNorm(nn.Module):
    """RMSNorm with a learnable gain (no bias): F.rms_norm, or its CPU fast path above."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == self.weight.dtype:
            return _RMSNormCPU.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(kind: str, dim: int, bias: bool, eps: float) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    return nn.Identity()


ACTIVATIONS = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
}


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
    """Q = (X + f(X)) / 2,  f(X) = LN(GELU(RMSNorm(X) W1) W2)  (Karbevski 2026, eq. for Q(X)).

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
        # unit variance per token at init, on the scale of the normalised X (PAPER.md).
        self.out_norm = make_norm(cfg.nl_out_norm, cfg.d_model, cfg.bias, cfg.norm_eps)
        self.explicit_half = cfg.nl_half == "explicit"
        self.scale_factor = 1.0 if self.explicit_half else 0.5

    def f(self, x: torch.Tensor) -> torch.Tensor:
        if self.fold_in_norm(x):
            h = _RMSNormLinearCPU.apply(x, self.in_norm.weight, self.w1.weight, self.in_norm.eps)
        else:
            h = self.w1(self.in_norm(x))  # (B, T, r)
        return self.out_norm(self.w2(self.act(h)))

    def fold_in_norm(self, x: torch.Tensor) -> bool:
        """The CPU fast path for RMSNorm then W1 (the paper's f) in fp32/fp64 without
        autocast; bias, other norms, GPU and autocast take the modules."""
        return (isinstance(self.in_norm, RMSNorm) and self.w1.bias is None
                and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
                and x.dtype == self.w1.weight.dtype == self.in_norm.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
