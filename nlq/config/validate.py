"""Checks on config values: types per key, then values per key and across keys.

Every error is an NlqError that names the key (`section.key`) and the value. The string
choices of the model's pluggable parts come from their registries (nlq.model.query.QUERIES,
nlq.model.layers.NORMS and ACTIVATIONS), so a new variant needs no edit here. This module
imports no other part of nlq.config but table.py: the schema imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from typing import TYPE_CHECKING, Any

from nlq.config.table import check_table
from nlq.errors import NlqError, short

if TYPE_CHECKING:
    from nlq.config.schema import Config, DataConfig, ModelConfig, TrainConfig

# The range of every integer key, (lowest, highest). Sizes stay below 2^31: a tensor
# dimension, and far beyond any memory long before that (nlq/train/memory.py refuses what
# does not fit this machine). Seeds are what numpy's SeedSequence takes (non-negative) and a
# TOML integer holds (64-bit); any other integer key must fit in 64 bits as well.
SIZE = (1, 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
INT_RANGES: dict[str, tuple[int, int]] = {
    **{f"model.{k}": SIZE for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head",
                                    "d_model", "mlp_hidden", "nl_rank")},
    **{f"train.{k}": SIZE for k in ("micro_batch", "grad_accum", "eval_batches")},
    **{f"train.{k}": (1, 2**63 - 1) for k in ("max_steps", "eval_interval", "log_interval",
                                              "ckpt_interval", "keep_checkpoints")},
    "train.warmup_steps": (0, 2**63 - 1),
    "train.seed": (0, 2**63 - 1),
    "data.seed": (0, 2**63 - 1),
}
# Linux's limits on a path and on one of its components, in bytes (PATH_MAX, NAME_MAX)
PATH_MAX, NAME_MAX = 4095, 255


def check_type(key: str, value: Any, tp: Any) -> Any:
    """Return value converted to tp (int -> float only), or raise naming key."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return check_type(key, value, args[0])
    if origin is dict:  # a TOML table of settings (model.query_args)
        return check_table(key, value)
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
    raise NlqError(f"config key '{key}' must be {name}, got {short(value)} "
                   f"({type(value).__name__})")


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
        raise NlqError(f"config key '{key}' = {short(value)} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise NlqError(f"config key '{key}' must be finite, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise NlqError(f"config key '{key}' must be {need}, got {value!r}")


@functools.cache
def _int_fields(cls: type) -> tuple[str, ...]:
    """The fields of a section whose type is int or int | None."""
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls)
                 if hints[f.name] is int or int in typing.get_args(hints[f.name]))


def check_ints(section: str, obj: Any) -> None:
    """Every integer key of a section within its range (INT_RANGES; 64 bits for the rest)."""
    for name in _int_fields(type(obj)):
        key, value = f"{section}.{name}", getattr(obj, name)
        lo, hi = INT_RANGES.get(key, INT64)
        if value is not None and not lo <= value <= hi:
            top = "2**31 - 1" if hi == SIZE[1] else "2**63 - 1" if hi == INT64[1] else hi
            raise NlqError(f"config key '{key}' must be an integer in [{lo}, {top}], got "
                           f"{short(value)}")


def check_path(key: str, value: str) -> None:
    """A path that no file system call can take is an error naming the key: too long as a
    whole or in one component, or with a NUL byte (caught here, it is not reported later as
    an I/O error of another file)."""
    if "\0" in value:
        raise NlqError(f"config key '{key}' = {short(value)} contains a NUL character")
    b = os.fsencode(value)
    if len(b) > PATH_MAX:
        raise NlqError(f"config key '{key}' = {short(value)}: path too long ({len(b)} bytes; "
                       f"the limit is {PATH_MAX})")
    part = max(b.split(b"/"), key=len)
    if len(part) > NAME_MAX:
        raise NlqError(f"config key '{key}' = {short(value)}: path too long (a name in it of "
                       f"{len(part)} bytes, {short(os.fsdecode(part), 40)}; the limit is "
                       f"{NAME_MAX})")


def _divisible(key: str, value: int, by_key: str, by: int) -> None:
    if value % by:
        raise NlqError(f"config key '{key}' = {value} is not divisible by {by_key} = {by}")


def validate_model(m: ModelConfig) -> None:
    """Impossible [model] values are errors that name the key and the value."""
    # Imported here, not at the top: importing nlq.config (the schema, `nlq config --doc`)
    # does not load torch.
    from nlq.model.layers import ACTIVATIONS, NORMS
    from nlq.model.query import QUERIES, check_query_args

    check_ints("model", m)
    _choice("model.arch", m.arch, ("decoder", "encoder", "prefix"))
    _choice("model.pos_emb", m.pos_emb, ("learned", "rope", "none"))
    _choice("model.query", m.query, tuple(QUERIES))
    check_query_args(m.query, m.query_args)
    _choice("model.nl_act", m.nl_act, tuple(ACTIVATIONS))
    _choice("model.nl_in_norm", m.nl_in_norm, tuple(NORMS))
    _choice("model.nl_out_norm", m.nl_out_norm, tuple(NORMS))
    _choice("model.nl_half", m.nl_half, ("fold", "explicit"))
    _divisible("model.d_model", m.d_model, "model.n_head", m.n_head)
    if m.n_kv_head is not None:
        _divisible("model.n_head", m.n_head, "model.n_kv_head", m.n_kv_head)
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
    check_ints("train", t)
    if getattr(t, "init_from", None) is not None:
        check_path("train.init_from", t.init_from)
    for k in ("lr", "eps"):
        _positive(f"train.{k}", getattr(t, k))
    for k in ("min_lr", "weight_decay", "grad_clip"):
        _positive(f"train.{k}", getattr(t, k), allow_zero=True)
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
        raise NlqError(f"config key 'train.device' = {short(t.device)} is not auto, cpu or "
                       f"cuda[:N]")


def validate_data(d: DataConfig) -> None:
    """Impossible [data] values are errors that name the key and the value."""
    check_ints("data", d)
    check_path("data.dir", d.dir)


def validate(cfg: Config) -> None:
    """Impossible values in any section, or across sections, name the key and the value."""
    m = cfg.model
    validate_model(m)
    validate_train(cfg.train)
    validate_data(cfg.data)
    obj = objective(cfg)
    if obj == "mlm" and m.arch != "encoder":
        raise NlqError(f"train.objective = 'mlm' needs model.arch = 'encoder', got {m.arch!r}")
    if obj == "clm" and m.arch == "encoder":
        raise NlqError("train.objective = 'clm' needs a causal model.arch (decoder or prefix)")
    masked = cfg.train.mlm_prob * m.block_size * cfg.train.micro_batch
    if obj == "mlm" and masked < 1:
        # fewer than one target per micro-batch on average: many micro-batches would have
        # none at all, and nothing to learn from
        raise NlqError(f"config key 'train.mlm_prob' = {cfg.train.mlm_prob!r} masks "
                       f"{masked:.3g} tokens per micro-batch on average (train.mlm_prob x "
                       f"model.block_size x train.micro_batch), fewer than 1: raise it")


def objective(cfg: Config) -> str:
    """The training objective: train.objective, or for "auto" the one the arch implies."""
    if cfg.train.objective != "auto":
        return cfg.train.objective
    return "mlm" if cfg.model.arch == "encoder" else "clm"
