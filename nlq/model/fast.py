"""Speed-ups applied from outside the model: one switch, apply_fast_paths(model, device).

The model's modules are the plain math (nlq/model/layers.py RMSNorm, nlq/model/query.py
NonlinearQuery, nlq/model/transformer.py Attention): what a reader sees there is the
reference. apply_fast_paths turns each such module of a built model into its subclass below,
which runs the same math faster on the device the run trains on. The parameters, their names
and the state dict do not change, so checkpoints load either way.

- CPU: hand-written autograd kernels (nlq/model/kernels.py) for RMSNorm and the paper's f,
  where the kernel applies (fp32/fp64, no autocast), the plain forward everywhere else.
  Committed golden losses (tests/golden/) were computed with them; they make a CPU step
  faster (benchmarks/RESULTS.md, the train_bench section on the CPU fast paths).
- CUDA: the query, key and value projections as one matrix product where the query is
  linear (the key and value ones where it is not): one GEMM of 3C columns fills the GPU
  better than three of C; and, unless the whole model is compiled anyway (train.compile),
  the paper's query as one torch.compile'd function of its tensors: in eager mode its two
  norms, GELU, add and scale would be a dozen separate memory-bound kernels per layer
  (benchmarks/RESULTS.md, the GPU section).

Both paths give the same values and gradients up to float rounding: tests/test_fast_paths.py
compares them module by module and over a whole training step on CPU, tests/test_gpu.py on
CUDA. The training set-up applies it (nlq/train/loop.py), as torchtitan applies compile and
parallelism to a plain model.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from nlq.model import kernels
from nlq.model.layers import RMSNorm
from nlq.model.query import LinearQuery, NonlinearQuery
from nlq.model.transformer import Attention


class FastRMSNorm(RMSNorm):
    """RMSNorm whose CPU backward is kernels.RMSNormCPU (F.rms_norm's CPU backward is several
    times slower, benchmarks/RESULTS.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == self.weight.dtype:
            return kernels.RMSNormCPU.apply(x, self.weight, self.eps)
        return super().forward(x)


def nonlinear_query(x, g_in, w1, w2, g_out, b_out, eps_in: float, eps_out: float,
                    approximate: str, explicit_half: bool):
    """The paper's query as a function of tensors (the same math as NonlinearQuery.forward
    with RMSNorm in, GELU, LayerNorm out, no biases): x + f(x), or (x + f(x)) / 2."""
    C = x.shape[-1]
    h = F.gelu(F.linear(F.rms_norm(x, (C,), g_in, eps_in), w1), approximate=approximate)
    q = x + F.layer_norm(F.linear(h, w2), (C,), g_out, b_out, eps_out)  # (B, T, C)
    return 0.5 * q if explicit_half else q


@functools.cache
def compiled_nonlinear_query():
    """nonlinear_query under torch.compile, built on first use: one graph for every layer
    (its inputs are tensors, not modules, so no layer recompiles it)."""
    return torch.compile(nonlinear_query)


class FastNonlinearQuery(NonlinearQuery):
    """NonlinearQuery whose x + f(x) runs as one autograd node, kernels.NonlinearQueryCPU, on
    CPU in fp32/fp64 without autocast, and as compiled_nonlinear_query() on the device types
    in `compiled_on` (apply_fast_paths' compile_query: ("cuda",); the tests add "cpu"). Only
    the paper's f (RMSNorm in, GELU, LayerNorm out, no biases) is made one: fits() says which
    modules qualify."""

    compiled_on: tuple[str, ...] = ()

    @staticmethod
    def fits(q: NonlinearQuery) -> bool:
        return (isinstance(q.in_norm, RMSNorm) and isinstance(q.out_norm, nn.LayerNorm)
                and isinstance(q.act, nn.GELU) and q.w1.bias is None and q.w2.bias is None)

    def fused_cpu(self, x: torch.Tensor) -> bool:
        """Whether forward takes the kernel for this input."""
        return (x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
                and x.dtype == self.w1.weight.dtype == self.in_norm.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type in self.compiled_on:
            return compiled_nonlinear_query()(
                x, self.in_norm.weight, self.w1.weight, self.w2.weight, self.out_norm.weight,
                self.out_norm.bias, self.in_norm.eps, self.out_norm.eps, self.act.approximate,
                self.explicit_half)
        if not self.fused_cpu(x):
            return super().forward(x)
        q = kernels.NonlinearQueryCPU.apply(
            x, self.in_norm.weight, self.w1.weight, self.w2.weight, self.out_norm.weight,
            self.out_norm.bias, self.in_norm.eps, self.out_norm.eps, self.act.approximate)
        return 0.5 * q if self.explicit_half else q


class FusedQKVAttention(Attention):
    """Attention whose projections run as one matrix product on CUDA: [W_Q; W_K; W_V] where
    the query is nn.Linear's (LinearQuery), [W_K; W_V] beside any other query. The weights
    stay three parameters (checkpoints and the other arms share their names); their
    concatenation is rebuilt at every call, 3 C^2 values against the (B T) x C x 3C product.
    Only on the device types in `fused_on`: on CPU the three products stay apart (the golden
    losses were computed so, and a fused GEMM may sum in another order; the tests add it)."""

    fused_on: tuple[str, ...] = ("cuda",)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if x.device.type not in self.fused_on:
            return super().qkv(x)
        fuse_q = type(self.q) is LinearQuery
        mods = ([self.q.proj] if fuse_q else []) + [self.k_proj, self.v_proj]
        w = torch.cat([m.weight for m in mods])  # (C + 2 nkv hs, C), or (2 nkv hs, C)
        b = torch.cat([m.bias for m in mods]) if self.k_proj.bias is not None else None
        out = F.linear(x, w, b)  # (B, T, C + 2 nkv hs), or (B, T, 2 nkv hs)
        kv = self.nkv * self.hs
        if fuse_q:
            q, k, v = out.split([out.shape[-1] - 2 * kv, kv, kv], dim=-1)
            return self.q.out_norm(q), k, v  # LinearQuery's norm after its projection
        k, v = out.split([kv, kv], dim=-1)
        return self.q(x), k, v


def apply_fast_paths(model: nn.Module, compile_query: bool = True) -> nn.Module:
    """model with its plain modules turned, in place, into the fast subclasses above; returns
    model. Each takes its fast path only on the device it is for (the kernels on CPU, the
    fused projections and the compiled query on CUDA), so the model may be moved after.
    compile_query: compile the paper's query on CUDA; False where the whole model is compiled
    anyway (train.compile fuses the query with the rest) or where a compile's start-up costs
    more than it saves (eval, sampling). Only the exact classes are swapped: a
    registered subclass with its own forward keeps it. Apply before torch.compile and
    before DDP / FSDP wrap the model."""
    for mod in model.modules():
        if type(mod) is RMSNorm:
            mod.__class__ = FastRMSNorm
        elif type(mod) is NonlinearQuery and FastNonlinearQuery.fits(mod):
            mod.__class__ = FastNonlinearQuery
            mod.compiled_on = ("cuda",) if compile_query else ()
        elif type(mod) is Attention:
            mod.__class__ = FusedQKVAttention
    return model
