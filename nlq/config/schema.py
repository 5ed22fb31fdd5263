"""The config's schema: frozen dataclasses, one per TOML section, and their plain-data forms.

A run's config has three sections, [model], [train] and [data]. [model] is the model's own
ModelConfig (nlq/model/config.py): the run's config is built on top of the model's, never
the other way round. Every field has a default and a docstring (the string literal under it;
`nlq config --doc` prints them). The defaults are the paper's GPT-3-small recipe
(docs/paper.md, "The training recipe"). Building a config from plain data (from_dict,
model_config_from_dict, Config.replace) checks every key, type and value
(nlq/config/validate.py), and reads an old config's model.nl_* keys as the nonlinear
query's query_args (nlq/model/config.py, upgrade).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

import tomli_w

from nlq.checks import build_section
from nlq.config.validate import validate, validate_model
from nlq.errors import NlqError
from nlq.model.config import LEGACY_KEYS, ModelConfig, read_model_config


@dataclass(frozen=True)
class TrainConfig:
    micro_batch: int = 12
    """Sequences per micro-step per process. The paper: 12 (docs/paper.md, "The training
    recipe")."""
    grad_accum: int = 40
    """Micro-steps per optimizer step, summed over all processes. The paper: 40
    (docs/paper.md, "The training recipe")."""
    max_steps: int = 60002
    """Optimizer steps of the run; the cosine decay reaches min_lr at the last one. The
    paper: 60,002 steps, about 29.5B tokens (docs/paper.md, "The training recipe")."""
    lr: float = 6e-4
    """Peak learning rate > 0, reached after warmup. The paper's baseline: 6e-4
    (docs/paper.md, "The training recipe")."""
    min_lr: float = 6e-5
    """Learning rate at the last step, the end of the cosine decay; 0 <= min_lr <= lr. The
    paper's baseline: 6e-5 (docs/paper.md, "The training recipe")."""
    warmup_steps: int | None = None
    """Steps of linear warmup up to lr (nanoGPT), then cosine decay to min_lr. None (the
    default): max(50, 5% of max_steps), long enough that a short run does not spike at the
    end of its warmup (the `warmup` property is the value used). The paper: 2000
    (docs/paper.md, "The training recipe"; the gpt3-small preset sets it)."""
    beta1: float = 0.9
    """AdamW beta1 in [0, 1). The paper: 0.9 (docs/paper.md, "The training recipe")."""
    beta2: float = 0.95
    """AdamW beta2 in [0, 1). The paper: 0.95 (docs/paper.md, "The training recipe")."""
    eps: float = 1e-8
    """AdamW epsilon > 0 (torch's default)."""
    weight_decay: float = 0.1
    """AdamW decay >= 0 on 2-D weight matrices only; norms and biases never. The paper's
    baseline: 0.1 (docs/paper.md, "The training recipe")."""
    decay_embeddings: bool = True
    """Whether the token/position embedding matrices are decayed too; nanoGPT and the paper
    decay every 2-D parameter, embeddings included (docs/paper.md, "The training recipe")."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this (>= 0); 0 turns clipping off. The paper: 1.0
    (docs/paper.md, "The training recipe")."""
    eval_interval: int = 1000
    """Steps between validation evaluations; the final step always evaluates. The paper:
    1000 (docs/paper.md, "The training recipe")."""
    eval_batches: int = 200
    """Fixed val windows = eval_batches * micro_batch. The paper: 200 x 12 (docs/paper.md,
    "The training recipe")."""
    log_interval: int = 1
    """Steps between train rows (loss, grad norm, lr) in metrics.jsonl; 1 logs every step, so
    a spike (nlq/train/spikes.py) is seen where it happens."""
    ckpt_interval: int = 1000
    """Steps between checkpoints; the final step and a stop by signal always save one."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints stay on disk; older ones are deleted."""
    seed: int = 1337
    """Model init (and dropout/masking) seed; the data order has its own seed (data.seed)."""
    init_from: str | None = None
    """Start from another model's weights (a path, relative to the working directory): an nlq
    run dir (its newest checkpoint that verifies), a checkpoint dir (RUN/ckpt/step_N), a
    save_pretrained folder, or a Hugging Face GPT-2 folder (config.json with model_type
    "gpt2", model.safetensors or pytorch_model.bin). Tensors whose name and shape match are
    copied; the model's others keep their fresh init from train.seed (e.g. the nonlinear
    query's f when the source is linear, whose attn.q.proj is dropped); a shared name with
    another shape (another d_model, vocab_size, ...) is an error naming the tensor. Applied
    at step 0 only: a resumed run continues from its own checkpoint. The resolved path and
    the weights file's sha256 go into the meta row of metrics.jsonl. None: the fresh init."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    precision: str = "auto"
    """auto (fp32 on CPU, bf16 autocast on CUDA) | fp32 | bf16. The paper: bf16 autocast
    (docs/paper.md, "The training recipe")."""
    compile: bool = False
    """torch.compile the model with its loss, as one graph (every block on its own under
    FSDP, which shards block by block). The paper's runs compile (docs/paper.md, "The
    training recipe"); off by default so that a run starts at once. Without it, on CUDA the
    paper's query alone is compiled (nlq/model/fast.py)."""
    compile_mode: str = "default"
    """torch.compile's mode with train.compile: default | max-autotune-no-cudagraphs (slower
    to compile, tries more kernels). The CUDA-graph modes are not offered: they failed in
    training (benchmarks/RESULTS.md, the GPU section)."""
    fused_adamw: bool = True
    """Use torch's fused AdamW kernel (CUDA and CPU); other devices reject it."""
    objective: str = "auto"
    """auto (clm for decoder/prefix, mlm for encoder) | clm | mlm."""
    mlm_prob: float = 0.15
    """Masked-LM: fraction of tokens predicted, in (0, 1) (80% [MASK], 10% random, 10%
    unchanged)."""
    prefix_frac: float = 0.5
    """Prefix-LM: the first prefix_frac * T tokens, prefix_frac in [0, 1), attend
    bidirectionally and carry no loss."""
    parallel: str = "ddp"
    """Multi-process wrapping under torchrun: ddp | fsdp (FSDP2 fully_shard)."""
    test_eval: bool = True
    """At the end of the run, score the whole test split of data.dir document by document
    (summary.json: test_loss, test_ppl, test_tokens, test_docs; test_docs.json: nats and
    tokens per document), the numbers a report compares. Needs a data dir with a test split
    (`nlq prepare` writes one by default)."""
    threads: int | None = None
    """CPU threads of the run's intra-op pool (torch.set_num_threads); None: torch's default
    (OMP_NUM_THREADS, else the machine's cores). On CPU a run's numbers are bitwise
    reproducible only at a fixed thread count and instruction set: both change the order in
    which floats are summed, and training amplifies such differences (docs/experiments.md,
    2026-12-04, numerical noise). summary.json records the count used and the ISA."""
    wandb_project: str | None = None
    """Also log every metrics row to this Weights & Biases project (needs the wandb extra;
    credentials and WANDB_MODE from the environment). None: no W&B. metrics.jsonl stays the
    record reports read; a resumed run continues its W&B run (RUN/wandb_id)."""

    @property
    def warmup(self) -> int:
        """The warmup used: warmup_steps, or max(50, max_steps // 20) when it is None."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(50, self.max_steps // 20)


@dataclass(frozen=True)
class DataConfig:
    dir: str = "data/owt-gpt2"
    """Folder written by `nlq prepare` (train.bin, val.bin, meta.json)."""
    seed: int = 2357
    """Seed of the batch schedule: same seed, same batches in the same order for every arm
    (docs/paper.md, "The training recipe")."""


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

    def replace(self, **overrides: Any) -> Config:
        """Copy with dotted overrides, e.g. replace(**{"model.query": "nonlinear"})."""
        return from_dict(apply_overrides(self.to_dict(), overrides))


# section name -> its dataclass, in file order
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}
# section name -> its fields that are tables of settings (`--set section.field.name=value`)
TABLES: dict[str, set[str]] = {
    sec: {k for k, tp in typing.get_type_hints(cls).items() if typing.get_origin(tp) is dict}
    for sec, cls in SECTIONS.items()}


# section name -> old keys still read (the model upgrades them when the config is built)
OLD_KEYS: dict[str, set[str]] = {"model": set(LEGACY_KEYS)}


def _section_dict(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _drop_none(d: dict) -> dict:
    """TOML has no null: an unset Optional is written as an absent key (its default), as is
    an empty table (model.query_args)."""
    return {k: (_drop_none(v) if isinstance(v, dict) else v) for k, v in d.items()
            if v is not None and v != {}}


def from_dict(d: dict) -> Config:
    """A validated Config from {section: {key: value}}; missing keys keep their defaults."""
    if not isinstance(d, dict):
        raise NlqError("a config must be a table with [model], [train] and [data] sections")
    unknown = sorted(set(d) - set(SECTIONS))
    if unknown:
        raise NlqError(
            f"unknown config section '{unknown[0]}' (known sections: {', '.join(SECTIONS)})"
        )
    parts = {}
    for name, cls in SECTIONS.items():
        raw = d.get(name, {})
        if not isinstance(raw, dict):
            raise NlqError(f"config key '{name}' must be a table, got {raw!r}")
        parts[name] = read_model_config(raw) if cls is ModelConfig else build_section(name, cls, raw)
    cfg = Config(**parts)
    validate(cfg)
    return cfg


def model_config_from_dict(raw: dict) -> ModelConfig:
    """A validated ModelConfig from {key: value} (e.g. a checkpoint's config.json), its query
    and query_args included: unknown keys, wrong types and impossible values raise NlqError
    naming `model.<key>`; old nl_* keys are read as query_args."""
    m = read_model_config(raw)
    validate_model(m)
    return m


def apply_overrides(d: dict, overrides: dict[str, Any]) -> dict:
    """d with dotted keys set; an override to an unknown key is an error naming it. A key
    inside a table field has three parts (model.query_args.rank)."""
    d = json.loads(json.dumps(d))  # deep copy of plain data
    for key, value in overrides.items():
        parts = key.split(".")
        if len(parts) not in (2, 3) or parts[0] not in SECTIONS:
            raise NlqError(
                f"unknown config key '{key}' (use section.key with section one of "
                f"{', '.join(SECTIONS)})"
            )
        sec, name = parts[:2]
        known = {f.name for f in dataclasses.fields(SECTIONS[sec])}
        if name not in known | OLD_KEYS.get(sec, set()):
            raise NlqError(f"unknown config key '{key}' (known keys of [{sec}]: "
                           f"{', '.join(sorted(known))})")
        if len(parts) == 2:
            d.setdefault(sec, {})[name] = value
        elif name in TABLES[sec]:
            table = d.setdefault(sec, {}).get(name)
            d[sec][name] = {**(table if isinstance(table, dict) else {}), parts[2]: value}
        else:
            raise NlqError(f"unknown config key '{key}' ({sec}.{name} is not a table)")
    return d
