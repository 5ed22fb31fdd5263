"""The model's own config: ModelConfig, the [model] section of a run's config, and its checks.

The model is the ground floor: this file imports nothing of nlq but base files (the typed
field checks in nlq/checks.py, the error type), as nanoGPT keeps GPTConfig beside GPT. The
run's Config (nlq/config/schema.py) is built on top of it. Which query variants exist and
what settings each takes is the query registry's to say (nlq/model/query.py: check_query);
everything else about a ModelConfig is checked here (check_model).

Old configs spelled the nonlinear query's settings as [model] keys, nl_rank, nl_act,
nl_in_norm, nl_out_norm and nl_half; upgrade() reads them as its query_args (LEGACY_KEYS), so
presets, run dirs, checkpoints and results/ written before still load to the same model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nlq.checks import SIZE, Table, build_section, check_ints, choice, divisible, positive
from nlq.errors import NlqError


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "decoder"
    """decoder (causal LM) | encoder (bidirectional, masked-LM head) | prefix (prefix-LM).
    The paper trains a decoder; its argument covers every mask (docs/paper.md, "The
    nonlinear query")."""
    vocab_size: int = 50304
    """Token ids 0..vocab_size-1; GPT-2's 50257 padded to a multiple of 64, as the paper
    (docs/paper.md, "The training recipe")."""
    block_size: int = 1024
    """Context length T in tokens; also the size of the learned position table. The paper:
    1024 (docs/paper.md, "The training recipe")."""
    n_layer: int = 12
    """Transformer blocks. The paper (GPT-3 small): 12 (docs/paper.md, "The training
    recipe")."""
    n_head: int = 12
    """Query heads; d_model / n_head = head_dim must be whole. The paper: 12 heads of 64
    (docs/paper.md, "The training recipe")."""
    n_kv_head: int | None = None
    """Key/value heads for grouped-query attention; None means n_head (plain MHA, as the
    paper), 1 is MQA. Must divide n_head."""
    d_model: int = 768
    """Model width C, the size of the residual stream. The paper: 768 (docs/paper.md, "The
    training recipe")."""
    mlp_hidden: int | None = None
    """MLP width; None means 4 * d_model. The paper: 4d = 3072, and 4.75d = 3648 in its
    +12.5% arm (docs/paper.md, "The other arms")."""
    bias: bool = False
    """Biases in every Linear and LayerNorm; RMSNorm has a gain only. The paper: none
    (docs/paper.md, "The training recipe")."""
    tie_embeddings: bool = True
    """The output head shares the token embedding matrix. The paper: tied (docs/paper.md,
    "The training recipe")."""
    dropout: float = 0.0
    """Dropout probability in [0, 1) on the embeddings, the attention weights and the
    residual branches. The paper: 0 (docs/paper.md, "The training recipe")."""
    pos_emb: str = "learned"
    """learned (absolute, GPT-2; the paper's nanoGPT model) | rope (rotary, applied to q and
    k) | none."""
    rope_base: float = 10000.0
    """RoPE base b > 0: pair j of a head rotates by position * b^(-2j/head_dim) radians.
    Used only with pos_emb = "rope"."""
    qk_norm: bool = False
    """RMSNorm on q and k per head (the stronger linear baseline of current recipes; not in
    the paper)."""
    query: str = "linear"
    """Query variant, a name in nlq.model.query.QUERIES: linear | identity | residual |
    nonlinear (docs/paper.md, "The nonlinear query" and "The other arms")."""
    query_args: dict[str, Any] = field(default_factory=Table)
    """The query variant's own settings, the TOML table [model.query_args] (name = bool,
    int, float or string; `--set model.query_args.NAME=VALUE`): the module is built as
    QUERIES[query](cfg, **query_args), so the keyword parameters of its class's __init__
    after cfg are what it accepts (those named like a [model] key, d_model, bias, norm_eps,
    come from [model]). The nonlinear query takes rank (r, default d_model // 2, the paper's
    d/2), act (gelu), in_norm (rmsnorm), out_norm (layernorm) and half (fold); NonlinearQuery
    in nlq/model/query.py documents them. An unknown name, or a required one left out, is an
    error when the config loads. Old configs' model.nl_rank, nl_act, nl_in_norm, nl_out_norm
    and nl_half are read as rank, act, in_norm, out_norm and half."""
    attn_scale: float | None = None
    """Attention logit scale > 0; None means 1/sqrt(head_dim). A query variant may multiply it
    (the nonlinear query with half = "fold" multiplies it by 1/2, as the official code;
    docs/paper.md, "The nonlinear query")."""
    attn_scale_mult: float = 1.0
    """Multiplies the logit scale (attn_scale, or 1/sqrt(head_dim)) for any query variant.
    0.5 gives the official code's 1/(2 sqrt(head_dim)), which it uses for its identity and
    residual arms too (docs/paper.md, "The other arms")."""
    norm_eps: float = 1e-5
    """Epsilon > 0 added to the variance in every LayerNorm and RMSNorm (GPT-2's 1e-5)."""
    init_std: float = 0.02
    """Std of the normal init of weights and embeddings; the residual output projections get
    init_std / sqrt(2 n_layer) (GPT-2, nanoGPT)."""
    init_nested: bool = False
    """Draw every weight matrix unit by unit (its rows; the MLP's output projection by its
    input columns, the MLP's hidden units) from one prefix-stable stream per tensor, so that a
    wider MLP starts with the narrower one's values in every hidden unit they share.
    Seed-paired arms that differ in MLP width (the +12.5% control) then share their initial
    values as arms that differ in the query do (common random numbers). The same distribution,
    N(0, std^2) per entry, other values: False keeps the draws of earlier runs. An 8-seed
    pilot at d=64 did not show the control's paired sd falling (docs/experiments.md, "nested
    init"); the study's ladder does not use it."""

    def __post_init__(self):
        # a dict given in code becomes a read-only Table: the config stays frozen, hashable
        object.__setattr__(self, "query_args", Table(self.query_args))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def mlp_width(self) -> int:
        return 4 * self.d_model if self.mlp_hidden is None else self.mlp_hidden


# The range of every integer [model] key that is a size (nlq/checks.py says why 2^31).
INT_RANGES: dict[str, tuple[int, int]] = {
    f"model.{k}": SIZE for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head",
                                 "d_model", "mlp_hidden")}

# Old [model] key -> the nonlinear query's setting (its query_args name), and the old key's
# default, which is the setting's default too: a default value moves nowhere, so an old
# config and a new one of the same model compare equal (a checkpoint's model_config on
# resume, a sweep's planned configs).
LEGACY_KEYS = {"nl_rank": "rank", "nl_act": "act", "nl_in_norm": "in_norm",
               "nl_out_norm": "out_norm", "nl_half": "half"}
LEGACY_DEFAULTS = {"nl_rank": None, "nl_act": "gelu", "nl_in_norm": "rmsnorm",
                   "nl_out_norm": "layernorm", "nl_half": "fold"}


def upgrade(raw: dict) -> dict:
    """raw [model] keys with the old nl_* keys moved into query_args: only the nonlinear query
    read them, so for another query they are dropped (they changed nothing), and a value at
    its old default is dropped too (the setting's default is the same). A key given both ways
    is an error naming both."""
    if not isinstance(raw, dict) or not any(k in raw for k in LEGACY_KEYS):
        return raw
    new = {k: v for k, v in raw.items() if k not in LEGACY_KEYS}
    table = new.get("query_args", {})
    if raw.get("query", ModelConfig.query) != "nonlinear" or not isinstance(table, dict):
        return new  # (a query_args that is no table is an error of its own, below)
    args = dict(table)
    for old, name in LEGACY_KEYS.items():
        if old not in raw or raw[old] == LEGACY_DEFAULTS[old]:
            continue
        if name in args:
            raise NlqError(f"config keys 'model.{old}' and 'model.query_args.{name}' are the "
                           f"same setting: give only model.query_args.{name}")
        args[name] = raw[old]
    if args:
        new["query_args"] = args
    return new


def check_model(m: ModelConfig) -> None:
    """Impossible [model] values are errors that name the key and the value (the query
    variant and its query_args: nlq.model.query.check_query)."""
    check_ints("model", m, INT_RANGES)
    choice("model.arch", m.arch, ("decoder", "encoder", "prefix"))
    choice("model.pos_emb", m.pos_emb, ("learned", "rope", "none"))
    divisible("model.d_model", m.d_model, "model.n_head", m.n_head)
    if m.n_kv_head is not None:
        divisible("model.n_head", m.n_head, "model.n_kv_head", m.n_kv_head)
    if m.pos_emb == "rope" and m.head_dim % 2:
        raise NlqError(f"model.pos_emb = 'rope' needs an even head_dim, got {m.head_dim}")
    if m.attn_scale is not None:
        positive("model.attn_scale", m.attn_scale)
    positive("model.attn_scale_mult", m.attn_scale_mult)
    if not 0.0 <= m.dropout < 1.0:
        raise NlqError(f"config key 'model.dropout' must be in [0, 1), got {m.dropout!r}")
    positive("model.norm_eps", m.norm_eps)
    positive("model.init_std", m.init_std)
    positive("model.rope_base", m.rope_base)


def read_model_config(raw: dict) -> ModelConfig:
    """A checked ModelConfig from {key: value} (a [model] table, a checkpoint's config.json),
    old nl_* keys upgraded; unknown keys, wrong types and impossible values raise NlqError
    naming `model.<key>`. The query is checked when the model builds it (make_query)."""
    if not isinstance(raw, dict):
        raise NlqError(f"a model config must be a table of model keys, got {raw!r}")
    m = build_section("model", ModelConfig, upgrade(raw))
    check_model(m)
    return m
