"""The batches of one rank: (inputs, targets) of its train micro-steps and its val chunks.

Every arm sees the same windows (nlq/data/schedule.py) and MLM masks are a function of the
data seed and the window's place in the schedule, so a resumed run, or one on another
number of ranks, sees the same batches. Targets of -1 carry no loss.
"""

from __future__ import annotations

import math

import torch

from nlq.config import Config, objective
from nlq.data.schedule import (
    MLM_TEST,
    MLM_TRAIN,
    MLM_VAL,
    TokenData,
    micro_indices,
    mlm_corrupt,
    train_batch,
    val_windows,
)
from nlq.errors import NlqError
from nlq.train.dist import World


class Batches:
    """The data of one rank of a run, opened and checked once (a bad data dir fails before
    any model is built)."""

    def __init__(self, cfg: Config, world: World, device: torch.device):
        t, m = cfg.train, cfg.model
        self.t, self.world, self.device = t, world, device
        self.seed, self.T, self.objective = cfg.data.seed, m.block_size, objective(cfg)
        self.data = TokenData.open(cfg.data.dir)
        self.data.check(m.vocab_size, self.T)
        self.mask_id = self.data.meta.get("mask_id")
        if self.objective == "mlm" and self.mask_id is None:
            if self.data.vocab_size >= m.vocab_size:
                raise NlqError(f"masked LM needs a mask token: data {cfg.data.dir} has none "
                               f"and model.vocab_size leaves no free id")
            self.mask_id = m.vocab_size - 1  # an id of the padded vocab that no text uses
        # the bidirectional prefix of a prefix-LM: the model attends over it, it carries no loss
        self.prefix_len = int(t.prefix_frac * self.T) if m.arch == "prefix" else None
        self.micros = micro_indices(t.grad_accum, world.rank, world.size)  # this rank's share
        self.val, self.val_valid = self._val_shard()
        if t.test_eval and self.data.test is None:
            self.data.test_docs()  # the error that names the folder, before any training

    def _val_shard(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's val chunks (n_chunks, B, T+1) and which windows are real (n_chunks, B).
        Rank r evaluates chunks r, r+W, ...; padding windows carry no tokens (FSDP needs every
        rank to run the same number of forwards)."""
        B, T, W = self.t.micro_batch, self.T, self.world.size
        n_val = self.t.eval_batches * B
        val = val_windows(self.data.val, self.seed, n_val, T)  # (n_val, T+1)
        self.data.check_ids(val, "val", "an eval window")
        n_chunks = math.ceil(n_val / (B * W))
        pad = n_chunks * B * W - n_val
        valid = torch.cat([torch.ones(n_val, dtype=torch.bool),
                           torch.zeros(pad, dtype=torch.bool)])
        val = torch.cat([val, val[:1].expand(pad, -1)])
        val = val.view(n_chunks * W, B, T + 1)[self.world.rank::W]  # (n_chunks, B, T+1)
        valid = valid.view(n_chunks * W, B)[self.world.rank::W]  # (n_chunks, B)
        return val, valid

    def train(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `micro` (global index) of optimizer step `step` (0-based)."""
        t = self.t
        w = train_batch(self.data.train, self.seed, step, micro, t.micro_batch, t.grad_accum,
                        self.T)  # (B, T+1)
        self.data.check_ids(w, "train", f"a window of step {step + 1}")
        return self._inputs_targets(w, (MLM_TRAIN, step, micro))

    def val_chunk(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's val chunk i; padding windows get no targets."""
        # masks keyed by the global chunk index: the same for every world size
        x, y = self._inputs_targets(self.val[i], (MLM_VAL, i * self.world.size + self.world.rank))
        y[~self.val_valid[i].to(self.device)] = -1
        return x, y

    def test_inputs_targets(self, w: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Test windows (b, T+1), -1 = padding, of global chunk `chunk` -> inputs, targets
        (b, T) on the device; padding carries no loss. MLM masks are keyed by the chunk and
        the data's split seed, so every run on the data masks the same test tokens."""
        pad = w < 0
        w = w.clamp(min=0)
        if self.objective == "clm":
            x, y = w[:, :-1], w[:, 1:].clone()  # (b, T) each
            y[pad[:, 1:]] = -1
            if self.prefix_len is not None:
                y[:, : self.prefix_len] = -1
        else:
            x, y = mlm_corrupt(w[:, :-1], int(self.data.meta.get("seed", 0)), (MLM_TEST, chunk),
                               self.t.mlm_prob, self.mask_id, self.data.vocab_size)
            y[pad[:, :-1]] = -1
        return x.to(self.device), y.to(self.device)

    def _inputs_targets(self, w: torch.Tensor, key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows (B, T+1) -> inputs, targets (B, T) each, on the device: next tokens (clm)
        or the masked-out originals (mlm)."""
        if self.objective == "clm":
            x, y = w[:, :-1], w[:, 1:].clone()  # (B, T) each
            if self.prefix_len is not None:
                y[:, : self.prefix_len] = -1
        else:
            x, y = mlm_corrupt(w[:, :-1], self.seed, key, self.t.mlm_prob, self.mask_id,
                               self.data.vocab_size)
        return x.to(self.device), y.to(self.device)
