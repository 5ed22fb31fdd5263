"""Checks on config values: types per key, then values per key and across keys.

Every error is an NlqError that names the key (`section.key`) and the value. The typed-field
checks every section shares are nlq/checks.py; the model checks its own section
(nlq/model/config.py check_model) and says which query variants exist and what settings each
takes (nlq/model/query.py check_query, reading its registry), so a new variant needs no edit
here. This module checks [train], [data] and what spans sections.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from nlq.checks import INT64, SIZE, check_ints, choice, positive
from nlq.errors import NlqError, short
from nlq.model.config import INT_RANGES as MODEL_INT_RANGES
from nlq.model.config import ModelConfig, check_model
from nlq.model.query import check_query

if TYPE_CHECKING:
    from nlq.config.schema import Config, DataConfig, TrainConfig

__all__ = ["INT64", "INT_RANGES", "SIZE", "objective", "validate", "validate_model"]

# The range of every integer key, (lowest, highest): the model's sizes (nlq/checks.py says
# why 2^31); seeds are what numpy's SeedSequence takes (non-negative) and a TOML integer
# holds (64-bit); any other integer key must fit in 64 bits as well.
INT_RANGES: dict[str, tuple[int, int]] = {
    **MODEL_INT_RANGES,
    **{f"train.{k}": SIZE for k in ("micro_batch", "grad_accum", "eval_batches")},
    **{f"train.{k}": (1, 2**63 - 1) for k in ("max_steps", "eval_interval", "log_interval",
                                              "ckpt_interval", "keep_checkpoints")},
    "train.warmup_steps": (0, 2**63 - 1),
    "train.threads": (1, 4096),  # more than this machine's cores is refused when a run starts
    "train.seed": (0, 2**63 - 1),
    "data.seed": (0, 2**63 - 1),
}
# torch.compile's modes that train here. The CUDA-graph modes (reduce-overhead, max-autotune)
# are left out: on an H200 a training step under them failed at the tied embedding's
# gradient ("accessing tensor output of CUDAGraphs that has been overwritten",
# benchmarks/RESULTS.md, the GPU section).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# Linux's limits on a path and on one of its components, in bytes (PATH_MAX, NAME_MAX)
PATH_MAX, NAME_MAX = 4095, 255


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


def validate_model(m: ModelConfig) -> None:
    """Impossible [model] values are errors that name the key and the value: the model's own
    checks, then its query registry's (the variant and its query_args)."""
    check_model(m)
    check_query(m)


def validate_train(t: TrainConfig) -> None:
    """Impossible [train] values are errors that name the key and the value."""
    check_ints("train", t, INT_RANGES)
    if getattr(t, "init_from", None) is not None:
        check_path("train.init_from", t.init_from)
    for k in ("lr", "eps"):
        positive(f"train.{k}", getattr(t, k))
    for k in ("min_lr", "weight_decay", "grad_clip"):
        positive(f"train.{k}", getattr(t, k), allow_zero=True)
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
    choice("train.precision", t.precision, ("auto", "fp32", "bf16"))
    choice("train.objective", t.objective, ("auto", "clm", "mlm"))
    choice("train.compile_mode", t.compile_mode, COMPILE_MODES)
    if t.compile_mode != "default" and not t.compile:
        raise NlqError(f"config key 'train.compile_mode' = {t.compile_mode!r} needs "
                       f"train.compile = true")
    choice("train.parallel", t.parallel, ("ddp", "fsdp"))
    if not (t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:")):
        raise NlqError(f"config key 'train.device' = {short(t.device)} is not auto, cpu or "
                       f"cuda[:N]")


def validate_data(d: DataConfig) -> None:
    """Impossible [data] values are errors that name the key and the value."""
    check_ints("data", d, INT_RANGES)
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
