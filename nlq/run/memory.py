"""Will a run fit? A closed-form estimate of a process's peak memory, checked before anything
is allocated.

A config too large for the machine otherwise fails late and badly: an allocator traceback,
or a model built layer by layer for minutes until the machine swaps. check_fits() compares
the estimate with the memory free on the device and refuses with one line that names the
key making the estimate large. Nothing is built: the parameter count is closed-form in
n_layer (nlq/model/params.py).

The estimate, in bytes. Legend: B = train.micro_batch, T = block_size, L = n_layer,
C = d_model, H = the MLP width, kv = the K/V width, r = nonlinear rank, nh = n_head, V = vocab_size,
P = parameters, a = bytes of an activation (4 in fp32, 2 under bf16 autocast).
- state, 16 P: fp32 weights, gradients and AdamW's two moments (+2 P for autocast's bf16
  copies of the weights); under FSDP shared among the ranks;
- activations, 2 B T (L (6 C + 2 kv + 2 H) + 3 C) a: per layer autograd keeps the block's
  input, both norms' outputs, q, k, v, the attention output and its projection's input,
  the MLP's hidden before and after the activation (counted with saved-tensor hooks: 6 C +
  2 kv + 2 H per token; Korthikanti et al. 2022, "Reducing Activation Recomputation",
  section 4.1, count the same 34 C bytes in 16 bits for GPT's layer), + 2 C + 2 r for the
  nonlinear query's f, + 2 C with qk_norm, + C with rope, + 2 C with dropout. Times 2: the
  measured peak holds as much again (gradients in flight during backward, temporaries the
  allocator keeps);
- attention scores, 3 B nh T^2 L a, where attention dropout runs on CPU: that takes the
  "math" attention, which keeps the probabilities, the dropout mask and the dropped
  probabilities. Fused kernels (CPU without dropout, CUDA) keep O(T) a row;
- the loss: on CPU (nlq/model/loss.py, chunked) 4 (V C + B T C + 3 n V), the output
  weight's and the hidden states' gradients in fp32 and one chunk of n rows of logits (3
  copies); on a GPU (plain logits) 4 (V C + B T C) + (a + 12) B T V, the logits in the
  compute dtype, their fp32 copy, log-softmax and its gradient;
- the test split's evaluation at the end of a run (train.test_eval), 8 B T V: full logits
  and their log-softmax in fp32 (reduction "none"), with the weights and AdamW state held;
- the fixed val windows, 18 eval_batches B (T + 1): int64 windows gathered through an int64
  index from the uint16 tokens.
Peak = state + val windows + max(activations + scores + loss, test logits).
It leaves out the interpreter and torch (a few hundred MB, already in use when the check
runs): it is what the config adds, a rough figure meant to tell "cannot fit" from "may
fit". tests/robustness/test_sizes.py compares it with the measured peak of real runs.

NLQ_MEMORY_CHECK=0 turns the check off (e.g. where swap or unified memory makes more room
than the device reports).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nlq.config import Config, ModelConfig, TrainConfig
from nlq.errors import NlqError

# the keys whose size drives the estimate, searched for the one to name
MODEL_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "mlp_hidden")
RANK = "model.query_args.rank"  # the nonlinear query's r (nlq/model/query.py), d_model // 2
TRAIN_KEYS = ("micro_batch", "eval_batches")


@dataclass
class Estimate:
    """Bytes of each part of a process's peak (see the module docstring) and the parameters."""

    params: int
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return self.parts["peak"]


def _bf16(cfg: Config, device: torch.device) -> bool:
    p = cfg.train.precision
    return p == "bf16" or (p == "auto" and device.type == "cuda")


def estimate(cfg: Config, device: torch.device, shards: int = 1) -> Estimate:
    """The peak memory of one training process of cfg on device (shards: FSDP's ranks)."""
    from nlq.model.loss import chunk_rows
    from nlq.model.params import count_params

    m, t = cfg.model, cfg.train
    B, T, L, C, V = t.micro_batch, m.block_size, m.n_layer, m.d_model, m.vocab_size
    P = count_params(m)[0]
    bf16 = _bf16(cfg, device)
    a = 2 if bf16 else 4
    state = (16 * P) // shards + (2 * P if bf16 else 0)
    per_layer = 6 * C + 2 * m.kv_heads * m.head_dim + 2 * m.mlp_width
    rank = m.query_args.get("rank", C // 2)  # the nonlinear query's r
    per_layer += ((2 * C + 2 * rank if m.query == "nonlinear" else 0)
                  + (2 * C if m.qk_norm else 0) + (C if m.pos_emb == "rope" else 0)
                  + (2 * C if m.dropout > 0 else 0))
    # x 2: at its peak a step holds what autograd saved and as much again: the gradients in
    # flight during backward and forward temporaries the allocator keeps (measured on CPU,
    # tests/robustness/test_sizes.py)
    acts = 2 * B * T * (L * per_layer + 3 * C) * a
    # attention dropout on CPU takes the "math" attention, which keeps (B, nh, T, T) tensors
    math_attn = m.dropout > 0 and device.type == "cpu"
    scores = 3 * B * m.n_head * T * T * L * a if math_attn else 0
    if device.type == "cpu":  # the chunked loss (Transformer.chunked_loss's default)
        loss = 4 * (V * C + B * T * C + 3 * chunk_rows(B * T, V, device) * V)
    else:  # whole (B T, V) logits: in bf16, their fp32 copy, log-softmax, its gradient
        loss = 4 * (V * C + B * T * C) + (a + 12) * B * T * V
    test_logits = 8 * B * T * V if t.test_eval else 0
    val = 18 * t.eval_batches * B * (T + 1)
    peak = state + val + max(acts + scores + loss, test_logits)
    return Estimate(P, {"state": state, "activations": acts, "scores": scores, "loss": loss,
                        "test_logits": test_logits, "val": val, "peak": peak})


def estimate_inference(m: ModelConfig) -> int:
    """Bytes to load a trained model and score one window on the CPU (`nlq eval`, `sample`,
    `convert`): its fp32 weights twice (the file's tensors and the model's) and a window's
    logits with their log-softmax."""
    from nlq.model.params import count_params

    return 8 * count_params(m)[0] + 8 * m.block_size * m.vocab_size


def available(device: torch.device) -> int | None:
    """Bytes free for this process on device: CUDA's free memory; on CPU the kernel's
    MemAvailable, or less where a cgroup (a container's limit) allows less. None if
    unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    for limit, used in (("memory.max", "memory.current"),  # cgroup v2, then v1
                        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap = Path("/sys/fs/cgroup", limit).read_text().strip()
            if cap != "max":
                free = min(free, int(cap) - int(Path("/sys/fs/cgroup", used).read_text()))
            break
        except (OSError, ValueError):
            continue
    return max(free, 0)


def gib(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.0f} KiB"


def _with(cfg: Config, key: str, value) -> Config:
    """cfg with key = value, and n_head / d_model kept whole multiples of each other (a
    smaller d_model stays a multiple of n_head; a smaller n_head a divisor of d_model)."""
    m = cfg.model
    if key == RANK:  # a setting in the query_args table; None: absent, the default
        args = {k: v for k, v in m.query_args.items() if k != "rank"}
        args.update({} if value is None else {"rank": value})
        return dataclasses.replace(cfg, model=dataclasses.replace(m, query_args=args))
    sec, name = key.split(".")
    if key == "model.d_model":
        value = max(m.n_head, value // m.n_head * m.n_head)
    if key == "model.n_head":
        value = math.gcd(m.d_model, value)
    part = dataclasses.replace(getattr(cfg, sec), **{name: value})
    if key == "model.n_head" and m.n_kv_head is not None:
        part = dataclasses.replace(part, n_kv_head=None)
    return dataclasses.replace(cfg, **{sec: part})


def dominant_key(cfg: Config, device: torch.device, shards: int = 1) -> str:
    """The size key that makes the estimate large: the one whose default value (the paper's
    GPT-3 small) would shrink it the most; where every key is at or below its default, the
    one whose halving would."""
    base = estimate(cfg, device, shards).total
    keys = [f"model.{k}" for k in MODEL_KEYS] + [f"train.{k}" for k in TRAIN_KEYS]
    keys += [RANK] if cfg.model.query == "nonlinear" else []
    defaults = {**{f"model.{f.name}": f.default for f in dataclasses.fields(ModelConfig)},
                **{f"train.{f.name}": f.default for f in dataclasses.fields(TrainConfig)},
                RANK: None}

    def shrink(key: str, value) -> float:
        return base / max(1, estimate(_with(cfg, key, value), device, shards).total)

    gain = {k: shrink(k, defaults[k]) for k in keys}
    best = max(keys, key=gain.__getitem__)
    if gain[best] > 1.5:
        return best
    current = {**{f"model.{k}": getattr(cfg.model, k) for k in MODEL_KEYS},
               **{f"train.{k}": getattr(cfg.train, k) for k in TRAIN_KEYS}}
    current["model.mlp_hidden"] = cfg.model.mlp_width
    current[RANK] = cfg.model.query_args.get("rank", cfg.model.d_model // 2)
    return max(keys, key=lambda k: shrink(k, max(1, current[k] // 2)))


def _value(cfg: Config, key: str):
    if key == RANK:
        return cfg.model.query_args.get("rank", cfg.model.d_model // 2)
    sec, name = key.split(".")
    return getattr(getattr(cfg, sec), name)


def check_fits(cfg: Config, device: torch.device, procs: int = 1, shards: int = 1,
               gpu_share: int = 1) -> None:
    """Raise NlqError, naming the key that dominates, unless procs training processes of cfg
    fit in the memory free on device (procs: processes sharing it, e.g. a CPU's torchrun
    ranks or `nlq reproduce --jobs`; shards: FSDP's ranks). gpu_share: runs started together
    on this GPU (`--launcher gpus --jobs N`, NLQ_GPU_SHARE): each may take 1/N of the card at
    most, since its siblings may not have allocated yet when it looks."""
    if os.environ.get("NLQ_MEMORY_CHECK", "1") == "0":
        return
    free = available(device)
    if free is None:
        return
    shared = ""
    if device.type == "cuda" and gpu_share > 1:
        total = int(torch.cuda.mem_get_info(device)[1])
        if total // gpu_share < free:
            free = total // gpu_share
            shared = f" (1/{gpu_share} of its {gib(total)}: {gpu_share} runs share this GPU)"
    est = estimate(cfg, device, shards)
    if est.total * procs <= free:
        return
    key = dominant_key(cfg, device, shards)
    p = est.parts
    parts = {f"weights, gradients and AdamW state of {est.params:,} parameters": p["state"],
             "activations of train.micro_batch x model.block_size":
                 p["activations"] + p["scores"] + p["loss"],
             "the test split's logits": p["test_logits"], "the val windows": p["val"]}
    big = ", ".join(f"{what} {gib(n)}" for what, n in parts.items() if n >= est.total / 10)
    each = f"{procs} processes x " if procs > 1 else ""
    raise NlqError(
        f"{key} = {_value(cfg, key)} does not fit: training needs about {each}"
        f"{gib(est.total)} ({big}) and {device.type} has {gib(free)} free{shared}: lower {key} (a "
        f"rough estimate, nlq/run/memory.py; NLQ_MEMORY_CHECK=0 skips it)")


def check_inference_fits(m: ModelConfig, what: str) -> None:
    """Raise NlqError unless the model of m loads and scores a window in the CPU's free
    memory; what names the model's source."""
    if os.environ.get("NLQ_MEMORY_CHECK", "1") == "0":
        return
    free = available(torch.device("cpu"))
    need = estimate_inference(m)
    if free is not None and need > free:
        raise NlqError(f"{what}: its model (vocab_size {m.vocab_size}, d_model {m.d_model}, "
                       f"n_layer {m.n_layer}) needs about {gib(need)} to load and the CPU has "
                       f"{gib(free)} free (NLQ_MEMORY_CHECK=0 skips this check)")
