"""The optimisation recipe of a run: the lr schedule, AdamW's parameter groups, dropout seeds.

docs/paper.md, "The training recipe": AdamW (0.9, 0.95), linear warmup then cosine decay to
min_lr at the last step, weight decay on 2-D matrices only. nlq/train/loop.py applies them
step by step.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from nlq.errors import NlqError
from nlq.model import Transformer


def lr_at(step: int, t) -> float:
    """lr of the optimizer step taken at `step` (0 .. max_steps - 1): linear warmup for
    warmup_steps (nanoGPT), then cosine from lr down to min_lr, reached at the last step
    (docs/paper.md, "The training recipe": cosine decay to min_lr at the last step)."""
    if step < t.warmup:
        return t.lr * (step + 1) / (t.warmup + 1)
    last = t.max_steps - 1
    if step >= last:
        return t.min_lr
    ratio = (step - t.warmup) / (last - t.warmup)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (t.lr - t.min_lr)


def make_optimizer(model: Transformer, t, device: torch.device,
                   params: dict[str, torch.Tensor] | None = None) -> torch.optim.AdamW:
    """Decay 2-D weight matrices only, never norms or biases. Embedding tables (the token
    table is also the tied output head) are 2-D and are decayed unless decay_embeddings is
    off: nanoGPT and the paper decay them. params: the tensors to optimise by the model's
    parameter names, in its order, where they are not the model's own (a stacked run's
    (K, ...) weights, nlq/train/stack.py): the groups are decided by the model's shapes."""
    emb = {"wte.weight", "wpe.weight"}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        group = decay if p.dim() >= 2 and (t.decay_embeddings or name not in emb) else no_decay
        group.append(p if params is None else params[name])
    # fused AdamW has CUDA and CPU kernels (torch >= 2.4); on other devices it is an error
    # rather than a silently ignored key
    if t.fused_adamw and device.type not in ("cuda", "cpu"):
        raise NlqError(f"train.fused_adamw = true is not supported on {device.type}: set it "
                       f"to false")
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=t.fused_adamw or None,
    )


def step_seed(seed: int, step: int, rank: int) -> int:
    """Dropout reseeded per step: a resumed run draws the same masks with no RNG state."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])
