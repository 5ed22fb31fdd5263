"""Norms and activations by name: the registries a query's string settings are checked against.

NORMS maps a name (the nonlinear query's in_norm, out_norm in [model.query_args]) to a
builder (dim, bias, eps) -> nn.Module; ACTIVATIONS maps its act to a module factory. A new
choice is a new entry here; NonlinearQuery reads these dicts, so it needs no other edit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with a learnable gain (no bias): y = x / sqrt(mean(x^2) + eps) * weight.
    Training on CPU swaps in a hand-written backward of the same math (nlq/model/fast.py)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


NORMS: dict[str, Callable[[int, bool, float], nn.Module]] = {
    "layernorm": lambda dim, bias, eps: nn.LayerNorm(dim, eps=eps, bias=bias),
    "rmsnorm": lambda dim, bias, eps: RMSNorm(dim, eps=eps),  # a gain only, never a bias
    "none": lambda dim, bias, eps: nn.Identity(),
}


def make_norm(kind: str, dim: int, bias: bool, eps: float) -> nn.Module:
    return NORMS[kind](dim, bias, eps)


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
}
