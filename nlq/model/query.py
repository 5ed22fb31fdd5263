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

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nlq.errors import NlqError
from nlq.model import kernels
from nlq.model.layers import ACTIVATIONS, RMSNorm, make_norm

if TYPE_CHECKING:  # the modules read cfg's fields; importing nlq.config here would be a cycle
    from nlq.config import ModelConfig


def _plain(cls, cfg, d_model, bias) -> tuple[int, bool]:
    """(d_model, bias) from a ModelConfig, or from plain arguments when there is none."""
    if cfg is not None:
        return cfg.d_model, cfg.bias
    if d_model is None:
        raise TypeError(f"{cls.__name__} needs a ModelConfig or d_model=")
    return int(d_model), bool(bias)


class LinearQuery(nn.Module):
    """Q = X W_Q: the standard projection (d^2 parameters)."""

    scale_factor = 1.0

    def __init__(self, cfg: ModelConfig | None = None, *, d_model: int | None = None,
                 bias: bool = False):
        super().__init__()
        d_model, bias = _plain(type(self), cfg, d_model, bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class IdentityQuery(nn.Module):
    """Q = X: W_Q = I, no parameters (Karbevski & Mijoski, arXiv 2510.23912)."""

    scale_factor = 1.0

    def __init__(self, cfg: ModelConfig | None = None, *, d_model: int | None = None,
                 bias: bool = False):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ResidualQuery(nn.Module):
    """Q = X + X W_Q: a linear residual, same parameter count as linear."""

    scale_factor = 1.0

    def __init__(self, cfg: ModelConfig | None = None, *, d_model: int | None = None,
                 bias: bool = False):
        super().__init__()
        d_model, bias = _plain(type(self), cfg, d_model, bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class NonlinearQuery(nn.Module):
    """Q = (X + f(X)) / 2,  f(X) = LN(GELU(RMSNorm(X) W1) W2)  (Karbevski 2026; docs/paper.md,
    "The nonlinear query").

    W1: C x r, W2: r x C with r = C/2 by default, so f has C^2 weights plus two norm gains.
    The identity term anchors f to the known-good identity query. With nl_half = "fold"
    forward returns X + f(X) and the 1/2 moves into the attention scale (scale_factor = 0.5),
    as the official code does (scale 1/(2 sqrt(hs))); "explicit" returns (X + f(X)) / 2.

    Built from a ModelConfig (inside nlq's attention) or from plain arguments, e.g.
    NonlinearQuery(d_model=64) in one's own attention: then half defaults to "explicit", so
    the module alone returns the paper's Q (no scale elsewhere to fold the 1/2 into).
    """

    def __init__(self, cfg: ModelConfig | None = None, *, d_model: int | None = None,
                 rank: int | None = None, bias: bool = False, act: str = "gelu",
                 in_norm: str = "rmsnorm", out_norm: str = "layernorm", eps: float = 1e-5,
                 half: str = "explicit"):
        super().__init__()
        d_model, bias = _plain(type(self), cfg, d_model, bias)
        if cfg is not None:
            rank, act, half = cfg.rank, cfg.nl_act, cfg.nl_half
            in_norm, out_norm, eps = cfg.nl_in_norm, cfg.nl_out_norm, cfg.norm_eps
        rank = d_model // 2 if rank is None else int(rank)
        if half not in ("fold", "explicit") or act not in ACTIVATIONS:
            raise ValueError(f"NonlinearQuery: half must be fold or explicit and act one of "
                             f"{', '.join(ACTIVATIONS)}; got {half!r}, {act!r}")
        self.in_norm = make_norm(in_norm, d_model, bias, eps)
        self.w1 = nn.Linear(d_model, rank, bias=bias)
        self.act = ACTIVATIONS[act]()
        self.w2 = nn.Linear(rank, d_model, bias=bias)
        # The output norm starts at weight 1, bias 0 (nn defaults): f(X) has zero mean and
        # unit variance per token at init, on the scale of the normalised X (docs/paper.md,
        # "The nonlinear query").
        self.out_norm = make_norm(out_norm, d_model, bias, eps)
        self.explicit_half = half == "explicit"
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


# their settings are [model] keys (nl_rank, nl_act, ...): they take no model.query_args
BUILT_IN = (LinearQuery, IdentityQuery, ResidualQuery, NonlinearQuery)


def register_query(name: str, cls: type[nn.Module], replace: bool = False) -> None:
    """Make `name` a valid model.query: cls(cfg, **cfg.query_args) builds the module from the
    ModelConfig and the variant's own settings, [model.query_args], which cls takes as
    keyword parameters after cfg (the block's normalised input x (B, T, C) -> the query
    (B, T, C); a `scale_factor` attribute, 1.0 if absent, multiplies the attention's logit
    scale). For `nlq train` / `nlq reproduce`, whose runs are new processes, put the call in
    a module and pass it with `nlq --import MODULE_OR_FILE ...` (examples/own_query.py)."""
    if not (isinstance(name, str) and name and isinstance(cls, type)
            and issubclass(cls, nn.Module)):
        raise TypeError("register_query(name: str, cls: an nn.Module subclass)")
    if name in QUERIES and QUERIES[name] is not cls and not replace:
        raise ValueError(f"query {name!r} is registered already (replace=True to replace it)")
    QUERIES[name] = cls


def check_query_args(name: str, args: Mapping[str, Any]) -> None:
    """An NlqError naming `model.query_args.<key>` unless QUERIES[name](cfg, **args) fits the
    class's __init__: every key one of its keyword parameters after cfg (any key when it
    takes **kwargs), every parameter without a default given. Checked when a config loads,
    so a typo stops the run before it starts."""
    cls = QUERIES[name]
    if cls in BUILT_IN:
        if args:
            raise NlqError(f"config key 'model.query_args.{next(iter(args))}': the built-in "
                           f"query {name!r} takes no query_args (they are a registered "
                           f"variant's own settings; the built-in ones are [model] keys, "
                           f"e.g. model.nl_rank)")
        return
    params = list(inspect.signature(cls).parameters.values())[1:]  # after cfg
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in args:
        if key not in {p.name for p in named}:
            raise NlqError(f"config key 'model.query_args.{key}' is not a setting of query "
                           f"{name!r} ({cls.__name__} takes: "
                           f"{', '.join(p.name for p in named) or 'none'})")
    for p in named:
        if p.default is p.empty and p.name not in args:
            raise NlqError(f"query {name!r} needs config key 'model.query_args.{p.name}' "
                           f"({cls.__name__}'s {p.name} has no default)")


def make_query(cfg: ModelConfig) -> nn.Module:
    check_query_args(cfg.query, cfg.query_args)  # also for a ModelConfig built in code
    return QUERIES[cfg.query](cfg, **cfg.query_args)
