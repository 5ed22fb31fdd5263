"""The batches of one rank: (inputs, targets) of its train micro-steps and its val chunks.

Every arm sees the same windows (nlq/data/schedule.py) and MLM masks are a function of the
data seed and the window's place in the schedule, so a resumed run, or one on another
number of ranks, sees the same batches. Targets of -1 carry no loss.

On CUDA the next micro-batch is built ahead, in a thread, into pinned memory while the GPU
runs the current one, and copied without blocking: the step never waits for the CPU
(benchmarks/RESULTS.md, the GPU section: the loader's share of a step). On CPU nothing runs
ahead: there the work would only compete with the step for the same cores.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor

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
from nlq.model.transformer import prefix_lm_mask
from nlq.run.world import World


class Ahead:
    """build(*key) -> host tensors, fetched onto `device` by get(key, next_key). On CUDA the
    item of next_key is built meanwhile in a thread, into pinned memory, so that get() of it
    only queues a non-blocking copy behind the running step; elsewhere get() builds and
    copies at once. An item asked for out of order is built on the spot (correct, not
    ahead)."""

    def __init__(self, build, device: torch.device, threaded: bool | None = None):
        """threaded: build ahead in a thread; None = on CUDA only (the tests turn it on for
        CPU, where nothing is pinned)."""
        self.build, self.device = build, device
        self.pinned = device.type == "cuda"
        threaded = self.pinned if threaded is None else threaded
        self._pool = ThreadPoolExecutor(1, "nlq-batches") if threaded else None
        self._next: tuple[tuple, Future] | None = None  # (key, its item being built)

    def _build_pinned(self, *key) -> tuple[torch.Tensor, ...]:
        items = self.build(*key)
        # contiguous first: the inputs are a view (w[:, :-1]) and pinning keeps its strides,
        # so the device copy would first make a pageable contiguous copy, synchronously
        return (tuple(x.contiguous().pin_memory() for x in items) if self.pinned
                else tuple(items))

    def get(self, key: tuple, next_key: tuple) -> tuple[torch.Tensor, ...]:
        if self._pool is None:
            return tuple(x.to(self.device) for x in self.build(*key))
        ready = self._next[1] if self._next is not None and self._next[0] == key else None
        if ready is None:  # the first step, or a step out of order
            ready = self._pool.submit(self._build_pinned, *key)
        self._next = (next_key, self._pool.submit(self._build_pinned, *next_key))
        return tuple(x.to(self.device, non_blocking=self.pinned) for x in ready.result())


class Batches:
    """The data of one rank of a run, opened and checked once (a bad data dir fails before
    any model is built)."""

    def __init__(self, cfg: Config, world: World, device: torch.device,
                 data: TokenData | None = None):
        """data: cfg.data.dir opened and checked already (the training set-up does it once,
        before the run dir is made); None opens and checks it here."""
        t, m = cfg.train, cfg.model
        self.t, self.world, self.device = t, world, device
        self.seed, self.T, self.objective = cfg.data.seed, m.block_size, objective(cfg)
        self.arch = m.arch
        if data is None:
            data = TokenData.open(cfg.data.dir)
            data.check(m.vocab_size, self.T)
        self.data = data
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
        self.ahead = Ahead(self.train_cpu, device)

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
        """Micro-batch `micro` (global index) of optimizer step `step` (0-based), on the
        device. On CUDA it was built ahead (see the module's docstring), and the one after it
        starts building now."""
        i = self.micros.index(micro)
        nxt = (step, self.micros[i + 1]) if i + 1 < len(self.micros) else (step + 1, self.micros[0])
        return self.ahead.get((step, micro), nxt)

    def train_cpu(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """train(step, micro) in host memory."""
        t = self.t
        w = train_batch(self.data.train, self.seed, step, micro, t.micro_batch, t.grad_accum,
                        self.T)  # (B, T+1)
        self.data.check_ids(w, "train", f"a window of step {step + 1}")
        # MLM masks keyed by the window's index in the step: the same for any micro-batch split
        return self._inputs_targets(w, (MLM_TRAIN, step), micro * t.micro_batch)

    def val_chunk(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's val chunk i; padding windows get no targets."""
        # MLM masks keyed by the window's index in the val set: the same for every world size
        # and micro-batch size (this rank's chunk i is global chunk i * W + rank)
        x, y = self._inputs_targets(self.val[i], (MLM_VAL,),
                                    (i * self.world.size + self.world.rank) * self.t.micro_batch)
        y[~self.val_valid[i]] = -1
        return x.to(self.device), y.to(self.device)

    def test_inputs_targets(self, w: torch.Tensor, chunk: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Test windows (b, T+1), -1 = padding, of global chunk `chunk` (micro_batch windows
        a chunk) -> inputs, targets (b, T) and the attention mask, on the device; padding
        carries no loss. MLM masks are keyed by the window's index and the data's split seed,
        so every run on the data masks the same test tokens whatever its micro_batch.

        The mask (for the model's attn_mask; None = the arch's own) keeps the padding of a
        short last window out of every real token's attention where attention looks ahead
        (encoder, a prefix-LM's prefix): the padding ids are real ids to the model. Under the
        causal mask no real token sees the padding that follows it."""
        pad = w < 0
        w = w.clamp(min=0)
        if self.objective == "clm":
            x, y = w[:, :-1], w[:, 1:].clone()  # (b, T) each
            y[pad[:, 1:]] = -1
            if self.prefix_len is not None:
                y[:, : self.prefix_len] = -1
        else:
            x, y = mlm_corrupt(w[:, :-1], int(self.data.meta.get("seed", 0)), (MLM_TEST,),
                               self.t.mlm_prob, self.mask_id, self.data.vocab_size,
                               chunk * self.t.micro_batch)
            y[pad[:, :-1]] = -1
        mask = None
        keys = ~pad[:, :-1]  # (b, T) real input tokens
        if self.arch != "decoder" and not bool(keys.all()):
            keys[:, 0] = True  # a padding-only row (an idle rank's chunk) still attends somewhere
            mask = keys[:, None, None, :]  # (b, 1, 1, T): every query, the real keys
            if self.arch == "prefix" and self.prefix_len is not None:
                mask = mask & prefix_lm_mask(self.T, self.prefix_len)  # (b, 1, T, T)
            mask = mask.to(self.device)
        return x.to(self.device), y.to(self.device), mask

    def _inputs_targets(self, w: torch.Tensor, key: tuple,
                        first_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows (B, T+1) -> inputs, targets (B, T) each, on the CPU: next tokens (clm)
        or the masked-out originals (mlm; the windows are first_row.. of what key names)."""
        if self.objective == "clm":
            x, y = w[:, :-1], w[:, 1:].clone()  # (B, T) each
            if self.prefix_len is not None:
                y[:, : self.prefix_len] = -1
        else:
            x, y = mlm_corrupt(w[:, :-1], self.seed, key, self.t.mlm_prob, self.mask_id,
                               self.data.vocab_size, first_row)
        return x, y
