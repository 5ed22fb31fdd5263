"""The validation loss of a run: a sum of nats over a sum of target tokens on the fixed val
windows, all-reduced over the ranks (so it is the same for every world size)."""

from __future__ import annotations

import contextlib
import math

import torch

from nlq.train import dist
from nlq.train.batches import Batches


@torch.no_grad()
def evaluate(wrapped: torch.nn.Module, batches: Batches, world: dist.World,
             autocast: contextlib.AbstractContextManager) -> tuple[float, float]:
    """(val loss, val perplexity) of the model on this rank's val chunks, all ranks."""
    wrapped.eval()
    nats = torch.zeros((), dtype=torch.float64, device=batches.device)
    count = torch.zeros((), dtype=torch.float64, device=batches.device)
    for i in range(batches.val.shape[0]):
        x, y = batches.val_chunk(i)
        with autocast:
            _, loss = wrapped(x, y, prefix_len=batches.prefix_len, reduction="sum")
        nats += loss.double()
        count += (y >= 0).sum()
    dist.all_reduce_sum(nats, world)
    dist.all_reduce_sum(count, world)
    wrapped.train()
    loss = (nats / count).item()
    return loss, math.exp(min(loss, 700.0))  # exp overflows a float beyond ~709
