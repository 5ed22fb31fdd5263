"""Checks on config values: types per key, then values per key and across keys.

Every error is an NlqError that names the key (`section.key`) and the value. The string
choices of the model's pluggable parts come from their registries (nlq.model.query.QUERIES,
nlq.model.layers.NORMS and ACTIVATIONS), so a new variant needs no edit here. This module
imports no other part of nlq.config: the schema imports it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import TYPE_CHECKING, Any

from nlq.errors import NlqError

if TYPE_CHECKING:
    from nlq.config.schema import Config, ModelConfig, TrainConfig


def check_type(key: str, value: Any, tp: Any) -> Any:
    """Return value converted to tp (int -> float only), or raise naming key."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return check_type(key, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a field type we do not support is a programming error
        raise TypeError(f"unsupported config type {tp} for {key}")
    name = getattr(tp, "__name__", str(tp))
    raise NlqError(f"config key '{key}' must be {name}, got {value!r} ({type(value).__name__})")


def build_section(name: str, cls: type, raw: dict) -> Any:
    """cls(**raw) with every key known and every value of its field's type (section [name])."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise NlqError(
            f"unknown config key '{name}.{unknown[0]}' (known keys of [{name}]: "
            f"{', '.join(sorted(known))})"
        )
    kw = {k: check_type(f"{name}.{k}", v, hints[k]) for k, v in raw.items()}
    return cls(**kw)


def _choice(key: str, value: str, allowed) -> None:
    if value not in allowed:
        raise NlqError(f"config key '{key}' = {value!r} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise NlqError(f"config key '{key}' must be finite, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise NlqError(f"config key '{key}' must be {need}, got {value!r}")


def _divisible(key: str, value: int, by_key: str, by: int) -> None:
    if value % by:
        raise NlqError(f"config key '{key}' = {value} is not divisible by {by_key} = {by}")


def validate_model(m: ModelConfig) -> None:
    """Impossible [model] values are errors that name the key and the value."""
    # Imported here, not at the top: importing nlq.config (the schema, `nlq config --doc`)
    # does not load torch.
    from nlq.model.layers import ACTIVATIONS, NORMS
    from nlq.model.query import QUERIES

    _choice("model.arch", m.arch, ("decoder", "encoder", "prefix"))
    _choice("model.pos_emb", m.pos_emb, ("learned", "rope", "none"))
    _choice("model.query", m.query, tuple(QUERIES))
    _choice("model.nl_act", m.nl_act, tuple(ACTIVATIONS))
    _choice("model.nl_in_norm", m.nl_in_norm, tuple(NORMS))
    _choice("model.nl_out_norm", m.nl_out_norm, tuple(NORMS))
    _choice("model.nl_half", m.nl_half, ("fold", "explicit"))
    for k in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
        _positive(f"model.{k}", getattr(m, k))
    _divisible("model.d_model", m.d_model, "model.n_head", m.n_head)
    if m.n_kv_head is not None:
        _positive("model.n_kv_head", m.n_kv_head)
        _divisible("model.n_head", m.n_head, "model.n_kv_head", m.n_kv_head)
    if m.mlp_hidden is not None:
        _positive("model.mlp_hidden", m.mlp_hidden)
    if m.nl_rank is not None and m.nl_rank < 1:
        raise NlqError(f"config key 'model.nl_rank' must be >= 1, got {m.nl_rank}")
    if m.pos_emb == "rope" and m.head_dim % 2:
        raise NlqError(f"model.pos_emb = 'rope' needs an even head_dim, got {m.head_dim}")
    if m.attn_scale is not None:
        _positive("model.attn_scale", m.attn_scale)
    _positive("model.attn_scale_mult", m.attn_scale_mult)
    if not 0.0 <= m.dropout < 1.0:
        raise NlqError(f"config key 'model.dropout' must be in [0, 1), got {m.dropout!r}")
    _positive("model.norm_eps", m.norm_eps)
    _positive("model.init_std", m.init_std)
    _positive("model.rope_base", m.rope_base)


def validate_train(t: TrainConfig) -> None:
    """Impossible [train] values are errors that name the key and the value."""
    for k in ("micro_batch", "grad_accum", "max_steps", "eval_interval", "eval_batches",
              "log_interval", "ckpt_interval", "keep_checkpoints"):
        _positive(f"train.{k}", getattr(t, k))
    for k in ("lr", "eps"):
        _positive(f"train.{k}", getattr(t, k))
    for k in ("min_lr", "weight_decay", "grad_clip"):
        _positive(f"train.{k}", getattr(t, k), allow_zero=True)
    if t.warmup_steps is not None:
        _positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
    if t.min_lr > t.lr:
        raise NlqError(f"config key 'train.min_lr' = {t.min_lr} is above train.lr = {t.lr}")
    for k in ("beta1", "beta2"):
        v = getattr(t, k)
        if not 0.0 <= v < 1.0:
            raise NlqError(f"config key 'train.{k}' must be in [0, 1), got {v!r}")
    if not 0.0 < t.mlm_prob < 1.0:
        raise NlqError(f"config key 'train.mlm_prob' must be in (0, 1), got {t.mlm_prob!r}")
    if not 0.0 <= t.prefix_frac < 1.0:
        raise NlqError(f"config key 'train.prefix_frac' must be in [0, 1), got {t.prefix_frac!r}")
    _choice("train.precision", t.precision, ("auto", "fp32", "bf16"))
    _choice("train.objective", t.objective, ("auto", "clm", "mlm"))
    _choice("train.parallel", t.parallel, ("ddp", "fsdp"))
    if not (t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:")):
        raise NlqError(f"config key 'train.device' = {t.device!r} is not auto, cpu or cuda[:N]")


def validate(cfg: Config) -> None:
    """Impossible values in any section, or across sections, name the key and the value."""
    m = cfg.model
    validate_model(m)
    validate_train(cfg.train)
    obj = objective(cfg)
    if obj == "mlm" and m.arch != "encoder":
        raise NlqError(f"train.objective = 'mlm' needs model.arch = 'encoder', got {m.arch!r}")
    if obj == "clm" and m.arch == "encoder":
        raise NlqError("train.objective = 'clm' needs a causal model.arch (decoder or prefix)")


def objective(cfg: Config) -> str:
    """The training objective: train.objective, or for "auto" the one the arch implies."""
    if cfg.train.objective != "auto":
        return cfg.train.objective
    return "mlm" if cfg.model.arch == "encoder" else "clm"
