"""Hand-written CPU autograd kernels: the same math as the plain modules, in fewer passes.

Legend: N rows (B*T flattened), C = d_model, r = the nonlinear query's rank.
On CPU (torch 2.13) the nonlinear query's extra cost over a linear one is memory traffic, not
FLOPs: elementwise passes over (N, C) and (N, r) tensors that autograd runs after the GEMMs
have evicted them from cache, and F.rms_norm's unfused backward (benchmarks/RESULTS.md, the
train_bench section on the CPU fast paths). These kernels compute the same values and
gradients in fewer passes.

Nothing in the model calls them: its modules (layers.RMSNorm, query.NonlinearQuery) are the
plain math, and nlq/model/fast.py's apply_fast_paths swaps in the module subclasses that run
these kernels where they apply. tests/test_fast_paths.py compares the two paths and the
benchmarks time both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, (..., 1); mean(x^2) as one fused
    reduction, ||x||^2 / C."""
    ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1])
    return torch.rsqrt(ms.add_(eps))


class RMSNormCPU(torch.autograd.Function):
    """y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), with a hand-written backward.

    On CPU F.rms_norm runs as a chain of unfused ops whose backward broadcasts and reduces
    through slow paths: fwd+bwd of a (2048, 256) input took 2-3.6 ms against ~0.3 ms for the
    fused layer_norm (benchmarks/RESULTS.md). Used by QK-norm and wherever NonlinearQueryCPU
    does not apply; the same math in a few in-place passes:
        dx = rstd * (g*w - xhat * mean(g*w * xhat)),   dw = sum over rows of g * xhat.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rs = rstd(x, eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rs)
        return torch.mul(x, rs).mul_(weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, weight, rs = ctx.saved_tensors
        xhat = x * rs  # (..., C)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)  # (N, C) -> (C,)
        dx = None
        if ctx.needs_input_grad[0]:
            gw = g * weight
            dot = (gw * xhat).mean(-1, keepdim=True)  # (..., 1)
            dx = torch.addcmul(gw, xhat, dot, value=-1.0).mul_(rs)
        return dx, dw, None


class NonlinearQueryCPU(torch.autograd.Function):
    """q = x + LN(GELU(RMSNorm(x) W1^T) W2^T), the paper's query without biases
    (docs/paper.md, "The nonlinear query"), in one autograd node with an exact hand-written
    backward. This form removes the passes autograd would make:
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
        rstd_in = rstd(x2, eps_in)  # (N, 1)
        wg = w1 * g  # (r, C)
        h = torch.mm(x2, wg.t()).mul_(rstd_in)  # (N, r)
        a = F.gelu(h, approximate=approx)  # (N, r)
        z = torch.mm(a, w2.t())  # (N, C)
        q, mean, rstd_out = torch.native_layer_norm(z, (C,), ln_w, ln_b, eps_out)
        q.add_(x2)  # the identity term, in place (layer_norm's backward does not need q)
        ctx.save_for_backward(x2, g, w1, w2, wg, rstd_in, h, a, z, mean, rstd_out, ln_w, ln_b)
        ctx.approx = approx
        return q.view(x.shape)  # (..., C)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq):
        x2, g, w1, w2, wg, rstd_in, h, a, z, mean, rstd_out, ln_w, ln_b = ctx.saved_tensors
        N, C = x2.shape
        dq2 = dq.reshape(N, C)  # (N, C)
        need = ctx.needs_input_grad
        dz, d_lnw, d_lnb = torch.ops.aten.native_layer_norm_backward(
            dq2, z, (C,), mean, rstd_out, ln_w, ln_b,
            [True, ln_w is not None and need[4], ln_b is not None and need[5]])
        dw2 = torch.mm(dz.t(), a) if need[3] else None  # (C, r)
        du = torch.ops.aten.gelu_backward(torch.mm(dz, w2), h, approximate=ctx.approx)
        du.mul_(rstd_in)  # (N, r)
        dx = None
        if need[0]:
            s = torch.linalg.vecdot(du, h).unsqueeze_(-1)  # (N, 1): sum_j du_j h_j
            dx = torch.addcmul(dq2, x2, s.mul_(rstd_in), value=-1.0 / C)  # (N, C)
            dx = dx.addmm_(du, wg).view(dq.shape)  # (..., C)
        dwg = torch.mm(du.t(), x2) if need[1] or need[2] else None  # (r, C)
        dg = (dwg * w1).sum(0) if need[1] else None
        dw1 = dwg * g if need[2] else None
        return dx, dg, dw1, dw2, d_lnw, d_lnb, None, None, None
