"""A run's set-up: the batches, the model (fast paths, compile, DDP / FSDP2), its optimizer
and precision, gathered in one Run that every step of nlq/train/loop.py shares."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from nlq.config import Config
from nlq.data.schedule import TokenData
from nlq.model import Transformer, apply_fast_paths
from nlq.run.batches import Batches
from nlq.run.world import World
from nlq.train import dist, faults, init_from
from nlq.train.optim import make_optimizer
from nlq.train.rundir import RunDir
from nlq.train.spikes import Spikes


@dataclass
class Run:
    """What the steps of one run share, built once by set_up()."""

    cfg: Config
    world: World
    device: torch.device
    files: RunDir
    batches: Batches
    wrapped: torch.nn.Module  # what trains: the model under DDP / FSDP2, or the model itself
    optimizer: torch.optim.AdamW
    autocast: contextlib.AbstractContextManager  # bf16 autocast, or nothing
    fault_hooks: faults.Faults | None  # NLQ_FAULT's kill points (the crash tests), else None
    params: dict[str, int]  # parameter counts, for the meta row and the summary
    spikes: Spikes  # the spike detector (nlq/train/spikes.py), restored on resume
    init: dict | None = None  # what train.init_from loaded at step 0, for the meta row
    depends: dict | None = None  # what checkpoints record and a resume checks (rank 0)
    # the runs trained together as one stacked model (nlq/train/stack.py); 0: trained alone
    stack: int = 0


def set_up(cfg: Config, files: RunDir, world: World, device: torch.device,
           init: init_from.Init | None = None, data: TokenData | None = None,
           depends: dict | None = None) -> Run:
    """The batches (the data is checked before any model is built), the model initialised
    from train.seed (then from init, train.init_from's tensors, where given), compiled per
    block and wrapped for DDP / FSDP2 (nlq/train/dist.py), its optimizer, the precision, and
    NLQ_FAULT's hooks where the crash tests set it."""
    t = cfg.train
    batches = Batches(cfg, world, device, data)
    model = Transformer(cfg.model, seed=t.seed)  # init keyed by (seed, name)
    # kernels of the same math: CPU autograd kernels; on CUDA fused projections and, unless
    # the whole model is compiled below, the paper's query compiled (nlq/model/fast.py)
    apply_fast_paths(model, compile_query=not t.compile)
    if init is not None:
        init_from.apply(init, model, verbose=world.main)
    model = model.to(device)
    params = {"params_total": model.num_params(),
              "params_non_embedding": model.num_params(non_embedding=True)}
    if t.compile:
        compile_model(model, t)
    wrapped = dist.wrap(model, t.parallel, world, device)
    # after wrapping: FSDP2 replaces the parameters with sharded DTensors
    optimizer = make_optimizer(model, t, device)
    bf16 = t.precision == "bf16" or (t.precision == "auto" and device.type == "cuda")
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())
    armed = faults.from_env()  # the crash tests' kill points (NLQ_FAULT); None outside tests
    if armed is not None:
        armed.attach(model, optimizer)
    return Run(cfg, world, device, files, batches, wrapped, optimizer, autocast, armed, params,
               Spikes(), init=init.record() if init is not None else None, depends=depends)


def compile_model(model: Transformer, t) -> None:
    """torch.compile in place: the whole model with its loss (one graph: the loss and the
    last block fuse, no graph boundary per block), or block by block under FSDP2, which
    shards and gathers per block (as torchtitan compiles), in train.compile_mode."""
    mode = None if t.compile_mode == "default" else t.compile_mode
    if t.parallel == "fsdp" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        for block in model.blocks:
            block.compile(mode=mode)
    else:
        model.compile(mode=mode)
