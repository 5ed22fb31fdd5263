"""Query modules: the one swappable part of attention.

Legend: B batch, T time, C = d_model, r = the nonlinear query's rank.
Each module maps the block's pre-attention normalised input x (B, T, C) to the query
(B, T, C) and exposes `scale_factor`, a constant the attention multiplies into its logit
scale (1 except for the folded nonlinear query). Keys and values are not here: they are
`attn.k_proj` / `attn.v_proj` in every variant, so their weights move between variants.
A new variant is a new class registered in QUERIES: config validation (model.query) and
the tests that loop over variants read the registry. Every variant, built-in or registered,
takes its own settings one way: the keyword parameters of its __init__ after cfg are what
[model.query_args] may set (check_query_args).

forward is the plain math. On CPU, training swaps in hand-written kernels of the same math
from outside (nlq/model/fast.py, apply_fast_paths); tests/test_fast_paths.py compares them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nlq.errors import NlqError, short
from nlq.model.config import ModelConfig
from nlq.model.layers import ACTIVATIONS, NORMS, make_norm

# [model] keys: a query takes them as keywords only to be built without a ModelConfig (e.g.
# NonlinearQuery(d_model=64) in one's own attention); with one they come from [model], and
# model.query_args may not set them.
MODEL_KEYS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


def _plain(cls, cfg, d_model, bias) -> tuple[int, bool]:
    """(d_model, bias) from a ModelConfig, or from plain arguments when there is none."""
    if cfg is not None:
        return cfg.d_model, cfg.bias
    if d_model is None:
        raise TypeError(f"{cls.__name__} needs a ModelConfig or d_model=")
    return int(d_model), bool(bias)


class LinearQuery(nn.Module):
    """Q = X W_Q: the standard projection (d^2 parameters); with out_norm, Q = N(X W_Q).

    Its setting ([model.query_args]): out_norm, a name in nlq.model.layers.NORMS applied to
    the projection over the whole d_model, default "none". "layernorm" gives the query the
    normalisation the paper's f ends in, keys untouched (the `linear-qnorm` arm: is the
    nonlinear query's gain that normalisation?). d_model and bias are [model] keys: given
    only to build it without a config."""

    scale_factor = 1.0

    def __init__(self, cfg: ModelConfig | None = None, *, out_norm: str = "none",
                 d_model: int | None = None, bias: bool = False, norm_eps: float = 1e-5):
        super().__init__()
        d_model, bias = _plain(type(self), cfg, d_model, bias)
        if out_norm not in NORMS:
            raise ValueError(f"out_norm = {short(out_norm)} is not one of {', '.join(NORMS)}")
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_norm = make_norm(out_norm, d_model, bias,
                                  cfg.norm_eps if cfg is not None else norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_norm(self.proj(x))


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
    The identity term anchors f to the known-good identity query.

    Its settings ([model.query_args]; the defaults are the paper's):
    - rank: r >= 1; None (absent) means d_model // 2;
    - act: the activation inside f, a name in nlq.model.layers.ACTIVATIONS (gelu, the exact
      erf form, as the paper);
    - in_norm, out_norm: f's input and output norms, names in nlq.model.layers.NORMS (the
      paper: rmsnorm in, layernorm out);
    - half: where the 1/2 of (X + f(X))/2 goes. "fold": forward returns X + f(X) and the 1/2
      moves into the attention scale (scale_factor = 0.5), as the official code does (scale
      1/(2 sqrt(hs))); "explicit": forward returns (X + f(X)) / 2. The two give the same
      attention unless qk_norm is on. None (absent) means "fold" inside nlq's attention
      (built from a ModelConfig) and "explicit" alone, e.g. NonlinearQuery(d_model=64) in
      one's own attention, which has no scale to fold the 1/2 into.
    d_model, bias and norm_eps are [model] keys: given only to build it without a config.
    """

    def __init__(self, cfg: ModelConfig | None = None, *, rank: int | None = None,
                 act: str = "gelu", in_norm: str = "rmsnorm", out_norm: str = "layernorm",
                 half: str | None = None, d_model: int | None = None, bias: bool = False,
                 norm_eps: float = 1e-5):
        super().__init__()
        d_model, bias = _plain(type(self), cfg, d_model, bias)
        eps = cfg.norm_eps if cfg is not None else norm_eps
        if half is None:
            half = "fold" if cfg is not None else "explicit"
        rank = d_model // 2 if rank is None else rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank = {short(rank)} must be an integer >= 1")
        for name, value, allowed in (("act", act, ACTIVATIONS), ("in_norm", in_norm, NORMS),
                                     ("out_norm", out_norm, NORMS),
                                     ("half", half, ("fold", "explicit"))):
            if value not in allowed:
                raise ValueError(f"{name} = {short(value)} is not one of {', '.join(allowed)}")
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x + self.f(x)
        return 0.5 * q if self.explicit_half else q


QUERIES: dict[str, type[nn.Module]] = {
    "linear": LinearQuery,
    "identity": IdentityQuery,
    "residual": ResidualQuery,
    "nonlinear": NonlinearQuery,
}


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


def settings(cls: type) -> list[inspect.Parameter] | None:
    """The settings a query class takes from [model.query_args]: the keyword parameters of its
    __init__ after cfg that are no [model] key; None when it takes **kwargs (any name)."""
    params = list(inspect.signature(cls).parameters.values())[1:]  # after cfg
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in MODEL_KEYS]


def check_query_args(name: str, args: Mapping[str, Any]) -> None:
    """An NlqError naming `model.query` unless name is registered, or `model.query_args.<key>`
    unless QUERIES[name](cfg, **args) fits the class's __init__: every key one of its settings (any key when it takes **kwargs), every
    setting without a default given. Checked when a config loads, so a typo stops the run
    before it starts."""
    if name not in QUERIES:
        raise NlqError(f"config key 'model.query' = {short(name)} is not one of "
                       f"{', '.join(QUERIES)}")
    cls = QUERIES[name]
    named = settings(cls)
    for key in args:
        if key in MODEL_KEYS:
            raise NlqError(f"config key 'model.query_args.{key}': {key} is a [model] key; set "
                           f"model.{key}")
        if named is not None and key not in {p.name for p in named}:
            raise NlqError(f"config key 'model.query_args.{key}' is not a setting of query "
                           f"{name!r} ({cls.__name__} takes: "
                           f"{', '.join(p.name for p in named) or 'none'})")
    for p in named or ():
        if p.default is p.empty and p.name not in args:
            raise NlqError(f"query {name!r} needs config key 'model.query_args.{p.name}' "
                           f"({cls.__name__}'s {p.name} has no default)")


def check_query(cfg: ModelConfig) -> None:
    """model.query is a registered name and model.query_args are settings it takes, with
    values it accepts: the module is built on the meta device (no memory, no init), and the
    ValueError or TypeError of a value it refuses becomes an NlqError naming the key."""
    check_query_args(cfg.query, cfg.query_args)
    try:
        with torch.device("meta"):
            QUERIES[cfg.query](cfg, **cfg.query_args)
    except (ValueError, TypeError) as e:
        raise NlqError(f"config key 'model.query_args' of query {cfg.query!r}: {e}") from None


def make_query(cfg: ModelConfig) -> nn.Module:
    check_query_args(cfg.query, cfg.query_args)  # also for a ModelConfig built in code
    return QUERIES[cfg.query](cfg, **cfg.query_args)
