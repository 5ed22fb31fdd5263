"""The ranks of a run: this process's World (one process, or one of torchrun's) and the one
collective that both training and scoring need, a sum over the ranks. On one process the sum
is a no-op; joining torchrun's process group is training's (nlq/train/dist.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place among the ranks: one process (the default) or torchrun's."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the one process that writes files and prints."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one process: collectives and wrapping apply."""
        return self.size > 1


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    """t summed over the ranks, in place (and returned)."""
    if world.active:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
