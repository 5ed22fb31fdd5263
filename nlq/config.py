"""Frozen config dataclasses, read from TOML with tomllib (never executed).

A run's config has three sections, [model], [train] and [data]. Every field has a docstring
(the string literal under it) and a default; the defaults are the paper's GPT-3-small
recipe (../shared/PAPER.md). Unknown keys, wrong types and impossible values raise NlqError
naming the key and the value; `--set section.key=value` overrides go through the same path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import tomli_w

from nlq.errors import NlqError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "decoder"
    """decoder (causal LM) | encoder (bidirectional, masked-LM head) | prefix (prefix-LM)."""
    vocab_size: int = 50304
    """GPT-2's 50257 padded to a multiple of 64 (PAPER.md)."""
    block_size: int = 1024
    """Context length T."""
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: Optional[int] = None
    """Key/value heads for grouped-query attention; None means n_head (plain MHA), 1 is MQA."""
    d_model: int = 768
    mlp_hidden: Optional[int] = None
    """MLP width; None means 4 * d_model."""
    bias: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    pos_emb: str = "learned"
    """learned (absolute, GPT-2) | rope (rotary, applied to q and k) | none."""
    rope_base: float = 10000.0
    qk_norm: bool = False
    """RMSNorm on q and k per head (the stronger linear baseline of current recipes)."""
    query: str = "linear"
    """Query variant: linear | identity | residual | nonlinear (nlq.model.query.QUERIES)."""
    attn_scale: Optional[float] = None
    """Attention logit scale; None means 1/sqrt(head_dim). A query variant may multiply it
    (the nonlinear query with nl_half = "fold" multiplies it by 1/2, as the official code)."""
    nl_rank: Optional[int] = None
    """Bottleneck width r of f; None means d_model // 2 (the paper: d^2 parameters)."""
    nl_act: str = "gelu"
    """Activation inside f: gelu | gelu_tanh | relu | silu | tanh."""
    nl_in_norm: str = "rmsnorm"
    """Norm on f's input: rmsnorm | layernorm | none."""
    nl_out_norm: str = "layernorm"
    """Norm on f's output: layernorm | rmsnorm | none."""
    nl_half: str = "fold"
    """Where the 1/2 of (X + f(X))/2 goes: fold (into the attention scale, as the official
    code) | explicit (Q is scaled). The two give the same output unless qk_norm is on."""
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def mlp_width(self) -> int:
        return 4 * self.d_model if self.mlp_hidden is None else self.mlp_hidden

    @property
    def rank(self) -> int:
        return self.d_model // 2 if self.nl_rank is None else self.nl_rank


@dataclass(frozen=True)
class TrainConfig:
    micro_batch: int = 12
    """Sequences per micro-step per process (the paper: 12)."""
    grad_accum: int = 40
    """Micro-steps per optimizer step, summed over all processes (the paper: 40)."""
    max_steps: int = 60002
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 2000
    """Linear warmup; then cosine decay to min_lr at max_steps."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """AdamW decay on 2-D weight matrices only; norms and biases never."""
    decay_embeddings: bool = True
    """Whether the token/position embedding matrices are decayed too (nanoGPT and the paper
    decay every 2-D parameter, embeddings included)."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this; 0 turns clipping off."""
    eval_interval: int = 1000
    eval_batches: int = 200
    """Fixed val windows = eval_batches * micro_batch (the paper: 200 x 12)."""
    log_interval: int = 10
    ckpt_interval: int = 1000
    keep_checkpoints: int = 2
    seed: int = 1337
    """Model init (and dropout/masking) seed; the data order has its own seed (data.seed)."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    precision: str = "auto"
    """auto (fp32 on CPU, bf16 autocast on CUDA) | fp32 | bf16."""
    compile: bool = False
    fused_adamw: bool = True
    """Use torch's fused AdamW kernel (CUDA and CPU); other devices reject it."""
    objective: str = "auto"
    """auto (clm for decoder/prefix, mlm for encoder) | clm | mlm."""
    mlm_prob: float = 0.15
    """Masked-LM: fraction of tokens predicted (80% [MASK], 10% random, 10% unchanged)."""
    prefix_frac: float = 0.5
    """Prefix-LM: the first prefix_frac * T tokens attend bidirectionally and carry no loss."""
    parallel: str = "ddp"
    """Multi-process wrapping under torchrun: ddp | fsdp (FSDP2 fully_shard)."""


@dataclass(frozen=True)
class DataConfig:
    dir: str = "data/owt-gpt2"
    """Folder written by `nlq prepare` (train.bin, val.bin, meta.json)."""
    seed: int = 2357
    """Seed of the batch schedule: same seed, same batches in the same order for every arm."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict:
        return {s.name: _section_dict(getattr(self, s.name)) for s in dataclasses.fields(self)}

    def to_toml(self) -> str:
        return tomli_w.dumps(_drop_none(self.to_dict()))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **overrides: Any) -> "Config":
        """Copy with dotted overrides, e.g. replace(**{"model.query": "nonlinear"})."""
        return from_dict(apply_overrides(self.to_dict(), overrides))


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore


def _section_dict(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _drop_none(d: dict) -> dict:
    """TOML has no null: an unset Optional is written as an absent key (its default)."""
    return {k: (_drop_none(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}


# ---------------------------------------------------------------------------------------
# typing and validation


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return value converted to tp (int -> float only), or raise naming key."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _check_type(key, value, args[0])
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


def _build_section(name: str, cls: type, raw: dict) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise NlqError(
            f"unknown config key '{name}.{unknown[0]}' (known keys of [{name}]: "
            f"{', '.join(sorted(known))})"
        )
    kw = {k: _check_type(f"{name}.{k}", v, hints[k]) for k, v in raw.items()}
    return cls(**kw)


def from_dict(d: dict) -> Config:
    if not isinstance(d, dict):
        raise NlqError("a config must be a table with [model], [train] and [data] sections")
    unknown = sorted(set(d) - set(SECTIONS))
    if unknown:
        raise NlqError(
            f"unknown config section '{unknown[0]}' (known sections: {', '.join(SECTIONS)})"
        )
    parts = {}
    for name, factory in SECTIONS.items():
        raw = d.get(name, {})
        if not isinstance(raw, dict):
            raise NlqError(f"config key '{name}' must be a table, got {raw!r}")
        parts[name] = _build_section(name, type(factory()), raw)
    cfg = Config(**parts)
    validate(cfg)
    return cfg


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise NlqError(f"config key '{key}' = {value!r} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise NlqError(f"config key '{key}' must be finite, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise NlqError(f"config key '{key}' must be {need}, got {value!r}")


def validate(cfg: Config) -> None:
    """Impossible values are errors that name the key and the value."""
    from nlq.model.query import QUERIES  # the registry is the one source of variant names

    m, t = cfg.model, cfg.train
    _choice("model.arch", m.arch, ("decoder", "encoder", "prefix"))
    _choice("model.pos_emb", m.pos_emb, ("learned", "rope", "none"))
    _choice("model.query", m.query, tuple(QUERIES))
    _choice("model.nl_act", m.nl_act, ("gelu", "gelu_tanh", "relu", "silu", "tanh"))
    _choice("model.nl_in_norm", m.nl_in_norm, ("rmsnorm", "layernorm", "none"))
    _choice("model.nl_out_norm", m.nl_out_norm, ("layernorm", "rmsnorm", "none"))
    _choice("model.nl_half", m.nl_half, ("fold", "explicit"))
    for k in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
        _positive(f"model.{k}", getattr(m, k))
    if m.d_model % m.n_head:
        raise NlqError(
            f"config key 'model.d_model' = {m.d_model} is not divisible by "
            f"model.n_head = {m.n_head}"
        )
    if m.n_kv_head is not None:
        _positive("model.n_kv_head", m.n_kv_head)
        if m.n_head % m.n_kv_head:
            raise NlqError(
                f"config key 'model.n_head' = {m.n_head} is not divisible by "
                f"model.n_kv_head = {m.n_kv_head}"
            )
    if m.mlp_hidden is not None:
        _positive("model.mlp_hidden", m.mlp_hidden)
    if m.nl_rank is not None and m.nl_rank < 1:
        raise NlqError(f"config key 'model.nl_rank' must be >= 1, got {m.nl_rank}")
    if m.pos_emb == "rope" and m.head_dim % 2:
        raise NlqError(f"model.pos_emb = 'rope' needs an even head_dim, got {m.head_dim}")
    if m.attn_scale is not None:
        _positive("model.attn_scale", m.attn_scale)
    if not 0.0 <= m.dropout < 1.0:
        raise NlqError(f"config key 'model.dropout' must be in [0, 1), got {m.dropout!r}")
    _positive("model.norm_eps", m.norm_eps)
    _positive("model.init_std", m.init_std)
    _positive("model.rope_base", m.rope_base)

    for k in ("micro_batch", "grad_accum", "max_steps", "eval_interval", "eval_batches",
              "log_interval", "ckpt_interval", "keep_checkpoints"):
        _positive(f"train.{k}", getattr(t, k))
    for k in ("lr", "eps"):
        _positive(f"train.{k}", getattr(t, k))
    for k in ("min_lr", "weight_decay", "grad_clip", "warmup_steps"):
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
        raise NlqError(f"config key 'train.device' = {t.device!r} is not auto, cpu or cuda[:N]")
    obj = objective(cfg)
    if obj == "mlm" and m.arch != "encoder":
        raise NlqError(f"train.objective = 'mlm' needs model.arch = 'encoder', got {m.arch!r}")
    if obj == "clm" and m.arch == "encoder":
        raise NlqError("train.objective = 'clm' needs a causal model.arch (decoder or prefix)")


def objective(cfg: Config) -> str:
    if cfg.train.objective != "auto":
        return cfg.train.objective
    return "mlm" if cfg.model.arch == "encoder" else "clm"


# ---------------------------------------------------------------------------------------
# overrides and loading


def parse_value(text: str) -> Any:
    """A --set value is a TOML value (3e-4, true, "x", 12); a bare word is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise NlqError(f"--set expects section.key=value, got {item!r}")
        out[key.strip()] = parse_value(value.strip())
    return out


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def apply_overrides(d: dict, overrides: dict[str, Any]) -> dict:
    """d with dotted keys set; an override to an unknown key is an error naming it."""
    d = json.loads(json.dumps(d))  # deep copy of plain data
    for key, value in overrides.items():
        parts = key.split(".")
        if len(parts) != 2 or parts[0] not in SECTIONS:
            raise NlqError(
                f"unknown config key '{key}' (use section.key with section one of "
                f"{', '.join(SECTIONS)})"
            )
        sec, name = parts
        known = {f.name for f in dataclasses.fields(type(SECTIONS[sec]()))}
        if name not in known:
            raise NlqError(f"unknown config key '{key}' (known keys of [{sec}]: "
                           f"{', '.join(sorted(known))})")
        d.setdefault(sec, {})[name] = value
    return d


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NlqError(f"config file not found: {path}") from None
    except UnicodeDecodeError:
        raise NlqError(f"config file {path} is not UTF-8 text") from None
    except IsADirectoryError:
        raise NlqError(f"config path {path} is a directory, expected a TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise NlqError(f"config file {path} is not valid TOML: {e}") from None


def preset_path(name: str) -> Path:
    p = PRESET_DIR / f"{name}.toml"
    if not p.is_file():
        names = sorted(x.stem for x in PRESET_DIR.glob("*.toml"))
        raise NlqError(f"unknown preset {name!r} (presets: {', '.join(names)})")
    return p


def load_config(source: str | Path | None = None, sets: dict[str, Any] | None = None) -> Config:
    """source: a TOML file, a preset name, or None (the defaults). A file may name a base
    preset with `preset = "tiny"` at its top; its own sections then override the preset."""
    if source is None:
        raw: dict = {}
    elif Path(source).suffix == ".toml" or Path(source).is_file():
        # is_file, not exists: a folder named like a preset (e.g. `--out tiny`) is no config
        raw = read_toml(source)
    elif Path(source).is_dir() and not (PRESET_DIR / f"{source}.toml").is_file():
        raise NlqError(f"config path {source} is a directory, expected a TOML file or a preset "
                       f"name")
    else:
        raw = read_toml(preset_path(str(source)))
    base = raw.pop("preset", None)
    if base is not None:
        if not isinstance(base, str):
            raise NlqError(f"config key 'preset' must be a preset name, got {base!r}")
        base_raw = read_toml(preset_path(base))
        base_raw.pop("preset", None)
        raw = apply_overrides(base_raw, flatten(raw))
    return from_dict(apply_overrides(raw, sets or {}))


def config_from_toml(text: str) -> Config:
    try:
        return from_dict(tomllib.loads(text))
    except tomllib.TOMLDecodeError as e:
        raise NlqError(f"config is not valid TOML: {e}") from None
