"""The LM loss straight from the hidden states: output projection + cross-entropy in chunks.

Legend: N = B*T rows, C = d_model, V vocab, n rows of one chunk.
The plain path materialises (N, V) logits, their log-softmax, its gradient and a zero-filled
one-hot gradient: four (N, V) fp32 tensors per step. At the tiny benchmark shape (N = 2048,
V = 8192) each is 64 MiB, above glibc's largest mmap threshold (32 MiB), so every one comes
from fresh pages and is page-faulted in again at every step; with the log-softmax passes
this was ~11% of a CPU training step (benchmarks/RESULTS.md, the train_bench section on the
CPU fast paths). Here the loss is computed chunk by chunk of rows and each chunk's gradient
(softmax - one-hot) is formed while its logits are still in cache, then turned at once into
the gradients of the hidden states and of the weight; only (N, C) and (V, C) gradients are
kept for backward (as Liger-Kernel's fused linear cross-entropy does on GPU). Same math as
F.cross_entropy(h @ W.T, y).
"""

from __future__ import annotations

import torch

# Elements of one chunk's logits: 2^22 fp32 = 16 MiB on CPU (below the mmap threshold, so
# the buffer is reused from the heap; 512 rows at V = 8192). On GPU memory is not faulted in
# per step, so chunks only bound peak memory. Every chunk adds its (V, C) share into the
# weight gradient, a read and write of V*C floats; below ~256 rows that traffic outweighs the
# chunk's matmuls (measured at V = 50304, C = 768: 83-row chunks were 1.3x slower than one
# 256-row chunk), hence the floor.
CHUNK_ELEMENTS = {"cpu": 1 << 22}
CHUNK_ELEMENTS_DEFAULT = 1 << 28
MIN_CHUNK_ROWS = 256


def chunk_rows(n_rows: int, vocab: int, device: torch.device) -> int:
    budget = CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS_DEFAULT)
    return max(1, min(n_rows, max(MIN_CHUNK_ROWS, budget // vocab)))


def _sum_nats(h, weight, targets, ignore_index: int, rows: int, grad: bool):
    """Sum over rows of -log softmax(h W^T)[y], rows with y == ignore_index left out, and with
    grad its gradients (dh (N, C), dw (V, C)); h: (N, C), weight: (V, C), targets: (N,).

    Under autocast (bf16 on GPU) the matmuls run in the autocast dtype; the softmax and the
    sums in fp32 or wider, like the plain path's logits.float().
    """
    dev = h.device.type
    cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    acc = torch.promote_types(cdt, torch.float32)
    with torch.autocast(dev, enabled=False), torch.no_grad():
        w = weight.to(cdt)
        total = torch.zeros((), dtype=acc, device=h.device)
        dh = torch.empty_like(h) if grad else None  # (N, C)
        dw = torch.zeros_like(weight, dtype=acc) if grad else None  # (V, C)
        for s in range(0, h.shape[0], rows):
            hc, y = h[s : s + rows].to(cdt), targets[s : s + rows]  # (n, C), (n,)
            keep = y != ignore_index  # (n,)
            yc = torch.where(keep, y, 0)[:, None]  # (n, 1): any valid index for gather
            lp = torch.log_softmax((hc @ w.t()).to(acc), dim=-1)  # (n, V)
            total -= torch.where(keep, lp.gather(1, yc).squeeze(1), 0.0).sum()
            if not grad:
                continue
            # d(sum of nats)/d logits = softmax - one_hot(y), zero on ignored rows
            p = lp.exp_()  # (n, V), in place: lp is not needed any more
            p.scatter_add_(1, yc, -keep[:, None].to(p.dtype))
            if not bool(keep.all()):
                p.mul_(keep[:, None])
            p = p.to(cdt)
            dh[s : s + rows] = p @ w  # (n, V) @ (V, C) -> (n, C)
            if dw.dtype == cdt:  # accumulate in place, no (V, C) temporary
                dw.addmm_(p.t(), hc)  # (V, n) @ (n, C) -> (V, C)
            else:
                dw += (p.t() @ hc).to(acc)
    return total, dh, None if dw is None else dw.to(weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """_sum_nats with its gradients formed in forward, chunk by chunk, and scaled in backward."""

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index: int, rows: int):
        total, dh, dw = _sum_nats(h, weight, targets, ignore_index, rows, grad=True)
        ctx.save_for_backward(dh, dw)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        dh, dw = ctx.saved_tensors
        return dh * g, dw * g, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         reduction: str = "mean", ignore_index: int = -1) -> torch.Tensor:
    """F.cross_entropy(h @ weight.T, targets, reduction) without keeping (N, V) logits.

    h: (N, C), weight: (V, C), targets: (N,) int. reduction: "mean" (over rows whose target
    is not ignore_index) or "sum". With no such row the mean is 0 with zero gradients, not
    F.cross_entropy's NaN (0/0): a masked-LM micro-batch that happens to mask no token adds
    nothing to the step instead of stopping the run as diverged.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    rows = chunk_rows(h.shape[0], weight.shape[0], h.device)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        total = _LinearCrossEntropy.apply(h, weight, targets, ignore_index, rows)
    else:  # eval: no gradient work (a Function's forward cannot tell it is under no_grad)
        total = _sum_nats(h, weight, targets, ignore_index, rows, grad=False)[0]
    if reduction == "sum":
        return total
    return total / (targets != ignore_index).sum().clamp(min=1)
