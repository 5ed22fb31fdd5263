"""Training's torch.distributed: the process group, and DDP or FSDP2 applied to the model
from outside (torchtitan's order: compile per block, then wrap). nlq/model never sees any of
it. The World of ranks and the sum over them, which scoring needs too, are
nlq/run/world.py.

Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set) a process group is created: NCCL on
CUDA, gloo on CPU. Without torchrun everything here is a no-op on one process.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from nlq.errors import NlqError
from nlq.run.world import World


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise NlqError(f"train.device = {name!r} but CUDA is not available here "
                           "(use train.device = \"cpu\" or \"auto\")")
        return torch.device(name if ":" in name else f"cuda:{local_rank}")
    return torch.device("cpu")


def setup(device_name: str) -> tuple[World, torch.device]:
    """This process's World and device; joins torchrun's process group where there is one."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return World(), resolve_device(device_name)
    world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                  int(os.environ.get("LOCAL_RANK", "0")))
    device = resolve_device(device_name, world.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return world, device


def teardown(world: World) -> None:
    if world.active and dist.is_initialized():
        dist.barrier()  # without it gloo ranks can abort at exit
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, kind: str, world: World,
         device: torch.device) -> torch.nn.Module:
    """The model under DDP or FSDP2 (kind "ddp" | "fsdp"); the model itself on one process."""
    if not world.active:
        return model
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    return ddp(model, device)


def ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """model under DistributedDataParallel, as nlq trains it (the process group is joined)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # gradients live in DDP's all-reduce buckets: no copy of every gradient into them and back
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               gradient_as_bucket_view=True)


def grad_sync(wrapped: torch.nn.Module, kind: str, world: World, sync: bool):
    """Skip the gradient all-reduce on all but the last micro-step of an accumulation."""
    if not world.active or sync:
        if world.active and kind == "fsdp":
            wrapped.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if kind == "fsdp":
        wrapped.set_requires_gradient_sync(False)
        return contextlib.nullcontext()
    return wrapped.no_sync()


def max_over_ranks(value: int, world: World, device: torch.device) -> int:
    """The largest value over all ranks (one tiny all-reduce): ranks agree on a decision,
    e.g. stopping when a signal reached only some of them."""
    if not world.active:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(wrapped: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """Full (unsharded, CPU) model and optimizer state dicts keyed by parameter name; a
    collective under FSDP (every rank calls it), complete on rank 0."""
    return (get_model_state_dict(wrapped, options=_FULL),
            get_optimizer_state_dict(wrapped, optimizer, options=_FULL))


def load_full_state(wrapped: torch.nn.Module, optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load full state dicts (as saved by any world size) into this world's model."""
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(wrapped, model_sd, options=opts)
    set_optimizer_state_dict(wrapped, optimizer, optim_sd, options=opts)
