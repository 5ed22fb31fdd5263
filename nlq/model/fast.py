"""CPU speed-ups, applied from outside the model: one switch, apply_fast_paths(model).

The model's modules are the plain math (nlq/model/layers.py RMSNorm, nlq/model/query.py
NonlinearQuery): what a reader sees there is the reference. apply_fast_paths turns each such
module of a built model into its subclass below, whose forward runs a hand-written CPU
autograd kernel of the same math (nlq/model/kernels.py) where the kernel applies and the
plain forward everywhere else (GPU, bf16 autocast, a dtype the weights do not have). The
parameters, their names and the state dict do not change, so checkpoints load either way.

The training set-up applies it (nlq/train/loop.py), as torchtitan applies compile and
parallelism to a plain model: committed golden losses (tests/golden/) were computed with
these kernels, and the kernels make a CPU step faster (benchmarks/RESULTS.md, the
train_bench section on the CPU fast paths). Both paths give the same values and gradients up
to float rounding; tests/test_fast_paths.py compares them module by module and over a whole
training step.
"""

from __future__ import annotations

import torch
from torch import nn

from nlq.model import kernels
from nlq.model.layers import RMSNorm
from nlq.model.query import NonlinearQuery


class FastRMSNorm(RMSNorm):
    """RMSNorm whose CPU backward is kernels.RMSNormCPU (F.rms_norm's CPU backward is several
    times slower, benchmarks/RESULTS.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == self.weight.dtype:
            return kernels.RMSNormCPU.apply(x, self.weight, self.eps)
        return super().forward(x)


class FastNonlinearQuery(NonlinearQuery):
    """NonlinearQuery whose x + f(x) runs as one autograd node, kernels.NonlinearQueryCPU, on
    CPU in fp32/fp64 without autocast. Only the paper's f (RMSNorm in, GELU, LayerNorm out,
    no biases) is made one: fits() says which modules qualify."""

    @staticmethod
    def fits(q: NonlinearQuery) -> bool:
        return (isinstance(q.in_norm, RMSNorm) and isinstance(q.out_norm, nn.LayerNorm)
                and isinstance(q.act, nn.GELU) and q.w1.bias is None and q.w2.bias is None)

    def fused_cpu(self, x: torch.Tensor) -> bool:
        """Whether forward takes the kernel for this input."""
        return (x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
                and x.dtype == self.w1.weight.dtype == self.in_norm.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused_cpu(x):
            return super().forward(x)
        q = kernels.NonlinearQueryCPU.apply(
            x, self.in_norm.weight, self.w1.weight, self.w2.weight, self.out_norm.weight,
            self.out_norm.bias, self.in_norm.eps, self.out_norm.eps, self.act.approximate)
        return 0.5 * q if self.explicit_half else q


def apply_fast_paths(model: nn.Module) -> nn.Module:
    """model with every plain RMSNorm and every NonlinearQuery that fits the kernel turned, in
    place, into its fast subclass above; returns model. Only the exact classes are swapped: a
    registered subclass with its own forward keeps it. Apply before torch.compile and before
    DDP / FSDP wrap the model."""
    for mod in model.modules():
        if type(mod) is RMSNorm:
            mod.__class__ = FastRMSNorm
        elif type(mod) is NonlinearQuery and FastNonlinearQuery.fits(mod):
            mod.__class__ = FastNonlinearQuery
    return model
