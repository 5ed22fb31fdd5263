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
    overhead (issue 7). Used by QK-norm and where _NonlinearQueryCPU does not apply; the same
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


class _NonlinearQueryCPU(torch.autograd.Function):
    """q = x + LN(act(RMSNorm(x) W1^T) W2^T), the paper's query (no biases), in one autograd
    node with a hand-written backward, exact (CPU fast path, issue 7).

    On CPU the query's extra cost over a linear one is memory traffic, not FLOPs: the same
    C^2 multiply-adds, plus elementwise passes over (N, C) and (N, r) tensors that run after
    the GEMMs have evicted them from cache. This form removes the passes autograd would make:
    - the in-norm's gain is folded into W1 and its 1/rms applied to the (N, r) product,
      RMSNorm(x) W1^T = rstd * x (W1 g)^T, so no normalised (N, C) copy of x exists;
    - the identity term is added into the LayerNorm output in place, and its gradient is
      the starting value of the dx GEMM (addmm_) instead of a separate accumulation;
    - the (N, r) temporaries are scaled in place.
    Backward, with u = x (W1 g)^T, h = rstd * u, a = act(h), z = a W2^T, dq the incoming grad:
        dz = LN'(dq),  dW2 = dz^T a,  dh = act'(dz W2),  du = dh * rstd,
        dx = dq + du (W1 g) - x * rstd / C * sum_j(du_j h_j),
        d(W1 g) = du^T x,  dW1 = d(W1 g) * g,  dg = sum over rows of d(W1 g) * W1.
    (The rstd term: d rstd / dx = -rstd^3 x / C, and sum_j dh_j u_j = sum_j du_j h_j / rstd^2.)
    """

    @staticmethod
    def forward(ctx, x, g, w1, w2, ln_w, ln_b, eps_in: float, eps_out: float, approx: str):
        C = x.shape[-1]
        x2 = x.reshape(-1, C)  # (N, C)
        rstd = _rstd(x2, eps_in)  # (N, 1)
        wg = w1 * g  # (r, C)
        h = torch.mm(x2, wg.t()).mul_(rstd)  # (N, r)
        a = F.gelu(h, approximate=approx)  # (N, r)
        z = torch.mm(a, w2.t())  # (N, C)
        q, mean, rstd_out = torch.native_layer_norm(z, (C,), ln_w, ln_b, eps_out)
        q.add_(x2)  # the identity term, in place (layer_norm's backward does not need q)
        ctx.save_for_backward(x2, g, w1, w2, wg, rstd, h, a, z, mean, rstd_out, ln_w, ln_b)
        ctx.approx = approx
        return q.view(x.shape)  # (..., C)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq):
        x2, g, w1, w2, wg, rstd, h, a, z, mean, rstd_out, ln_w, ln_b = ctx.saved_tensors
        N, C = x2.shape
        dq2 = dq.reshape(N, C)  # (N, C)
        need = ctx.needs_input_grad
        dz, d_lnw, d_lnb = torch.ops.aten.native_layer_norm_backward(
            dq2, z, (C,), mean, rstd_out, ln_w, ln_b,
            [True, ln_w is not None and need[4], ln_b is not None and need[5]])
        dw2 = torch.mm(dz.t(), a) if need[3] else None  # (C, r)
        du = torch.ops.aten.gelu_backward(torch.mm(dz, w2), h, approximate=ctx.approx)
        du.mul_(rstd)  # (N, r)
        dx = None
        if need[0]:
            s = torch.linalg.vecdot(du, h).unsqueeze_(-1)  # (N, 1): sum_j du_j h_j
            dx = torch.addcmul(dq2, x2, s.mul_(rstd), value=-1.0 / C)  # (N, C)
            dx = dx.addmm_(du, wg).view(dq.shape)  # (..., C)
        dwg = torch.mm(du.t(), x2) if need[1] or need[2] else None  # (r, C)
        dg = (dwg * w1).sum(0) if need[1] else None
        dw1 = dwg * g if need[2] else None
        return dx, dg, dw1, dw2, d_lnw, d_lnb, None, None, None


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
        self.cpu_fast_path = True  # False: always the modules (benchmarks' "+modules")

    def f(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(self.in_norm(x))  # (B, T, r)
        return self.out_norm(self.w2(self.act(h)))

    def fused_cpu(self, x: torch.Tensor) -> bool:
        """Whether forward takes _NonlinearQueryCPU: the paper's f (RMSNorm in, GELU,
        LayerNorm out, no biases) on CPU in fp32/fp64 without autocast. Everything else
        (GPU, autocast, biases, other norms or activations) runs the modules above."""
        return (self.cpu_fast_path and isinstance(self.in_norm, RMSNorm)
                and isinstance(self.out_norm, nn.LayerNorm) and isinstance(self.act, nn.GELU)
                and self.w1.bias is None and self.w2.bias is None
                and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
                and x.dtype == self.w1.weight.dtype == self.in_norm.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_cpu(x):
            q = _NonlinearQueryCPU.apply(
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
