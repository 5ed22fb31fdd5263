"""The training loop: one function, read top to bottom in the order things happen.

Recipe (PAPER.md): AdamW (0.9, 0.95), grad clip 1.0, linear warmup then cosine decay to
min_lr at the last step, weight decay on 2-D matrices only, every arm on the same batches.
At each step boundary: eval (if due), checkpoint (if due), stop (if done or asked to);
then grad_accum micro-steps, clip, optimizer step, zero_grad. The final step always
evaluates and saves.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from nlq import __version__
from nlq.config import Config, config_from_toml, objective
from nlq.data.schedule import (MLM_TRAIN, MLM_VAL, TokenData, micro_indices, mlm_corrupt,
                               train_batch, val_windows)
from nlq.errors import NlqError
from nlq.fsutil import write_atomic
from nlq.model import Transformer
from nlq.train import alloc, checkpoint, dist as D, faults


class Diverged(NlqError):
    """A non-finite loss or gradient norm: the run stops, the last good checkpoint stays."""


def lr_at(step: int, t) -> float:
    """lr of the optimizer step taken at `step` (0 .. max_steps - 1): linear warmup for
    warmup_steps (nanoGPT), then cosine from lr down to min_lr, reached at the last step
    (PAPER.md: "cosine decay to min_lr at the last step")."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / (t.warmup_steps + 1)
    last = t.max_steps - 1
    if step >= last:
        return t.min_lr
    ratio = (step - t.warmup_steps) / (last - t.warmup_steps)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (t.lr - t.min_lr)


def make_optimizer(model: Transformer, t, device: torch.device) -> torch.optim.AdamW:
    """Decay 2-D weight matrices only, never norms or biases. Embedding tables (the token
    table is also the tied output head) are 2-D and are decayed unless decay_embeddings is
    off: nanoGPT and the paper decay them."""
    emb = {"wte.weight", "wpe.weight"}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and (t.decay_embeddings or name not in emb) else no_decay).append(p)
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


class RunDir:
    """The run dir's files, written by rank 0 only: config.toml, metrics.jsonl, tb/,
    ckpt/, summary.json, and a lock so two processes never write one run."""

    def __init__(self, path: Path, main: bool):
        self.path, self.main = path, main
        self.metrics_path = path / "metrics.jsonl"
        self._metrics = None
        self._tb = None
        self._lock = None

    def lock(self) -> None:
        try:
            self._lock = open(self.path / ".lock", "w")
        except OSError as e:  # a read-only dir, a file where the dir should be
            raise NlqError(f"cannot write run dir {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NlqError(f"another `nlq train` is running on {self.path} (it holds "
                           f"{self.path / '.lock'}); wait for it or use another --out") from None

    def open_logs(self, truncate_to: int | None, step: int) -> None:
        if truncate_to is not None and self.metrics_path.exists():
            # drop the lines written after the checkpoint we resume from
            os.truncate(self.metrics_path, truncate_to)
        self._metrics = open(self.metrics_path, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            purge = step if truncate_to is not None else None  # resumed: drop later events
            self._tb = SummaryWriter(str(self.path / "tb"), purge_step=purge)
        except ImportError:  # tensorboard is optional at run time
            self._tb = None

    def log(self, row: dict) -> None:
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("kind", "step") and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{row['kind']}/{k}", v, row["step"])

    def metrics_bytes(self) -> int:
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        return self.metrics_path.stat().st_size

    def close(self) -> None:
        for f in (self._metrics, self._tb, self._lock):
            if f is not None:
                # on a full disk a close may fail to flush; the error that got us here is
                # the one to report (metrics rows are flushed as they are written)
                with contextlib.suppress(OSError):
                    f.close()  # closing the lock file releases the lock


def prepare_run_dir(cfg: Config, run: RunDir, resume: bool) -> Config:
    """Lock the run dir first (so a second process is told about the first one). New run:
    check the data, then create the dir and write the resolved config; a failed start leaves
    no run dir behind. Resume: read the config back."""
    run_dir, cfg_path = run.path, run.path / "config.toml"
    if resume:
        if not cfg_path.is_file():
            raise NlqError(f"{run_dir} is not an nlq run dir (no config.toml): nothing to resume")
        run.lock()
        return config_from_toml(cfg_path.read_text())
    TokenData.open(cfg.data.dir).check(cfg.model.vocab_size, cfg.model.block_size)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        run.lock()
        if (run_dir / "ckpt").exists() or cfg_path.exists():
            raise NlqError(f"run dir {run_dir} already holds a run: continue it with "
                           f"`nlq train --resume {run_dir}` or choose another --out")
        write_atomic(cfg_path, cfg.to_toml())
    except OSError as e:
        raise NlqError(f"cannot write run dir {run_dir}: {e.strerror or e}") from None
    return cfg


def train(cfg: Config, run_dir: str | Path, resume: bool = False, progress: bool = True) -> dict:
    """Train cfg into run_dir (or resume it); returns the summary dict. Under torchrun every
    rank calls this; rank 0 alone writes files."""
    run_dir = Path(run_dir)
    if resume and (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
        print(f"nlq: {run_dir} already finished at step {summary['step']}", file=sys.stderr)
        return summary
    dd, device = D.setup(cfg.train.device)
    run = RunDir(run_dir, dd.main)
    try:
        if dd.main:
            cfg = prepare_run_dir(cfg, run, resume)
        elif resume:
            cfg = config_from_toml((run_dir / "config.toml").read_text())
        return _train(cfg, run, resume, progress, dd, device)
    except OSError as e:  # metrics, tb events or summary.json on a full or read-only disk
        where = f" ({e.filename})" if e.filename else ""
        raise NlqError(f"I/O error in run dir {run_dir}: {e.strerror or e}{where}; its "
                       f"checkpoints are kept: free space or fix permissions, then "
                       f"`nlq train --resume {run_dir}`") from None
    finally:
        run.close()
        D.teardown(dd)


def _train(cfg, run: RunDir, resume, progress, dd, device) -> dict:
    t, m = cfg.train, cfg.model
    obj = objective(cfg)
    T, B, A = m.block_size, t.micro_batch, t.grad_accum
    run_dir = run.path

    # -- data: the same windows for every arm (nlq/data/schedule.py) ---------------------
    data = TokenData.open(cfg.data.dir)
    data.check(m.vocab_size, T)
    mask_id = data.meta.get("mask_id")
    if obj == "mlm" and mask_id is None:
        if data.vocab_size >= m.vocab_size:
            raise NlqError(f"masked LM needs a mask token: data {cfg.data.dir} has none and "
                           f"model.vocab_size leaves no free id")
        mask_id = m.vocab_size - 1  # an id of the padded vocab that no text uses
    my_micros = micro_indices(A, dd.rank, dd.world)
    n_val = t.eval_batches * B
    val = val_windows(data.val, cfg.data.seed, n_val, T)  # (n_val, T+1)
    data.check_ids(val, "val", "an eval window")
    n_chunks = math.ceil(n_val / (B * dd.world))
    # rank r evaluates chunks r, r+W, ...; padding windows carry no tokens (FSDP needs every
    # rank to run the same number of forwards)
    pad = n_chunks * B * dd.world - n_val
    val_valid = torch.cat([torch.ones(n_val, dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)])
    val = torch.cat([val, val[:1].expand(pad, -1)])
    val = val.view(n_chunks * dd.world, B, T + 1)[dd.rank::dd.world]  # (n_chunks, B, T+1)
    val_valid = val_valid.view(n_chunks * dd.world, B)[dd.rank::dd.world]  # (n_chunks, B)

    # -- model and optimizer ----------------------------------------------------------------
    if device.type == "cpu":
        alloc.keep_freed_memory()  # no page faults on per-step buffers (nlq/train/alloc.py)
    torch.manual_seed(t.seed)
    model = Transformer(m).to(device)
    n_total, n_non_emb = model.num_params(), model.num_params(non_embedding=True)
    if t.compile:
        for block in model.blocks:
            block.compile()
    wrapped = D.wrap(model, t.parallel, dd, device)
    # after wrapping: FSDP2 replaces the parameters with sharded DTensors
    optimizer = make_optimizer(model, t, device)
    bf16 = t.precision == "bf16" or (t.precision == "auto" and device.type == "cuda")
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext())

    step, tokens, elapsed, metrics_offset = 0, 0, 0.0, None
    fresh = not resume or not checkpoint.any_saved(run_dir)
    if resume and fresh:
        # stopped before its first checkpoint: starting over from step 0 is exact (init,
        # batches and masks are functions of the config), so that is what resuming means
        metrics_offset = 0
        if dd.main:
            print(f"nlq: warning: {run_dir} has no checkpoint yet; starting it again from "
                  f"step 0", file=sys.stderr)
    elif resume:
        ck = checkpoint.load_latest(run_dir)
        if ck.state.get("model_config") != cfg.to_dict()["model"]:
            raise NlqError(f"checkpoint {ck.path} was written for another model config than "
                           f"{run_dir / 'config.toml'}")
        sd = dict(ck.model)
        if m.tie_embeddings:
            sd["lm_head.weight"] = sd["wte.weight"]
        try:
            D.load_full_state(wrapped, optimizer, sd,
                              checkpoint.flat_to_optim(ck.optim, ck.state["param_groups"]))
        except (RuntimeError, KeyError, ValueError) as e:
            why = " ".join(str(e).split())  # load_state_dict's message spans lines
            raise NlqError(f"checkpoint {ck.path} does not fit this model: {why}") from None
        step, tokens = ck.state["step"], ck.state["tokens"]
        elapsed, metrics_offset = ck.state["elapsed"], ck.state["metrics_bytes"]
    if dd.main:
        run.open_logs(metrics_offset, step)
        if fresh:
            run.log({"kind": "meta", "step": 0, "params_total": n_total,
                     "params_non_embedding": n_non_emb, "nlq_version": __version__,
                     "world_size": dd.world, "device": str(device)})

    def batch(micro: int, s: int, windows: torch.Tensor | None = None, key=None):
        """(inputs, targets) of one micro-batch; MLM masks are a function of the data seed."""
        if windows is None:
            w = train_batch(data.train, cfg.data.seed, s, micro, B, A, T)  # (B, T+1)
            data.check_ids(w, "train", f"a window of step {s + 1}")
        else:
            w = windows
        if obj == "clm":
            x, y = w[:, :-1], w[:, 1:].clone()  # (B, T) each
            if m.arch == "prefix":  # the bidirectional prefix carries no loss
                y[:, : int(t.prefix_frac * T)] = -1
        else:
            x, y = mlm_corrupt(w[:, :-1], cfg.data.seed, key or (MLM_TRAIN, s, micro),
                               t.mlm_prob, mask_id, data.vocab_size)
        return x.to(device), y.to(device)

    prefix_len = int(t.prefix_frac * T) if m.arch == "prefix" else None

    @torch.no_grad()
    def evaluate() -> tuple[float, float]:
        """Sum of nats over sum of target tokens on the fixed val windows, all ranks."""
        wrapped.eval()
        nats = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(val.shape[0]):
            # masks keyed by the global chunk index: the same for every world size
            x, y = batch(0, 0, val[i], key=(MLM_VAL, i * dd.world + dd.rank))
            y[~val_valid[i].to(device)] = -1
            with autocast:
                _, loss = wrapped(x, y, prefix_len=prefix_len, reduction="sum")
            nats += loss.double()
            count += (y >= 0).sum()
            faults.hit("eval")
        D.all_reduce_sum(nats, dd), D.all_reduce_sum(count, dd)
        wrapped.train()
        vl = (nats / count).item()
        return vl, math.exp(min(vl, 700.0))

    def save(s: int) -> None:
        model_sd, optim_sd = D.full_state(wrapped, optimizer)  # collective under FSDP
        if dd.main:
            if m.tie_embeddings:
                model_sd.pop("lm_head.weight", None)  # safetensors stores no aliases
            state = {"step": s, "tokens": tokens, "elapsed": elapsed,
                     "metrics_bytes": run.metrics_bytes(), "model_config": cfg.to_dict()["model"],
                     "param_groups": _groups_json(optim_sd["param_groups"]),
                     "world_size": dd.world, "nlq_version": __version__,
                     "rng": "derived: dropout reseeded from (train.seed, step, rank)"}
            checkpoint.save(run_dir, s, {k: v.contiguous() for k, v in model_sd.items()},
                            checkpoint.optim_to_flat(optim_sd), state, t.keep_checkpoints)

    # SIGINT / SIGTERM: finish the current step, checkpoint at the boundary, exit cleanly.
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    bar = None
    if dd.main and progress:
        from tqdm import tqdm

        bar = tqdm(total=t.max_steps, initial=step, desc=run_dir.name, unit="step",
                   dynamic_ncols=True, file=sys.stderr)
    tokens_per_step = A * B * T
    resumed_at = None if fresh else step
    val_loss = val_ppl = float("nan")
    t_last, tokens_last = time.perf_counter(), tokens
    try:
        while True:
            # -- step boundary: eval, checkpoint, stop ---------------------------------------
            boundary = step != resumed_at
            last = step >= t.max_steps
            if last and not boundary:  # resumed from the final checkpoint: recompute only
                val_loss, val_ppl = evaluate()
            if boundary and (step % t.eval_interval == 0 or last):
                val_loss, val_ppl = evaluate()
                if dd.main:
                    run.log({"kind": "eval", "step": step, "val_loss": val_loss,
                             "val_ppl": val_ppl, "tokens": tokens, "elapsed": elapsed})
                    if bar is not None:
                        bar.write(f"step {step}: val loss {val_loss:.4f}, ppl {val_ppl:.2f}")
            # a signal that reached any rank stops every rank at this same boundary
            signum = D.max_over_ranks(stop["signal"] or 0, dd, device)
            # never at step 0: there is nothing to keep, and a checkpoint without optimizer
            # state would resume with a differently initialised AdamW (torch's
            # set_optimizer_state_dict fills empty state with a step-1 state)
            if boundary and step > 0 and (last or step % t.ckpt_interval == 0
                                          or signum):
                save(step)
            if last:
                break
            if signum:
                if dd.main:
                    print(f"nlq: stopped by signal {signum} at step {step}; continue "
                          f"with `nlq train --resume {run_dir}`", file=sys.stderr)
                return {"status": "interrupted", "step": step}

            # -- one optimizer step: accumulate, clip, step ----------------------------------
            t0 = time.perf_counter()
            lr = lr_at(step, t)
            for g in optimizer.param_groups:
                g["lr"] = lr
            torch.manual_seed(step_seed(t.seed, step, dd.rank))
            loss_sum = torch.zeros((), device=device)
            for i, micro in enumerate(my_micros):
                x, y = batch(micro, step)
                with D.grad_sync(wrapped, t.parallel, dd, sync=i == len(my_micros) - 1):
                    with autocast:
                        _, loss = wrapped(x, y, prefix_len=prefix_len)
                    # mean over this rank's micro-steps; DDP/FSDP average over ranks
                    (loss / len(my_micros)).backward()
                loss_sum += loss.detach()
            clip = t.grad_clip if t.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), clip)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                              else grad_norm)
            train_loss = D.all_reduce_sum(loss_sum / len(my_micros), dd).item() / dd.world
            if faults.hit("nan"):
                train_loss = float("nan")
            if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
                raise Diverged(  # step + 1: the step being computed, as metrics count steps
                    f"training diverged at step {step + 1}: loss {train_loss}, grad norm "
                    f"{grad_norm} (lr {lr:.3g}); the last good checkpoint in "
                    f"{run_dir / 'ckpt'} is kept: lower train.lr or raise warmup_steps")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += tokens_per_step
            faults.hit("step")
            elapsed += time.perf_counter() - t0

            if dd.main and (step % t.log_interval == 0 or step == t.max_steps):
                now = time.perf_counter()
                tps = (tokens - tokens_last) / max(now - t_last, 1e-9)
                t_last, tokens_last = now, tokens
                run.log({"kind": "train", "step": step, "lr": lr, "loss": train_loss,
                         "grad_norm": grad_norm, "tokens": tokens, "tok_per_s": tps,
                         "elapsed": elapsed})
                if bar is not None:
                    bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tps:,.0f}")
            if bar is not None:
                bar.update(1)
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
        if bar is not None:
            bar.close()

    summary = {"status": "finished", "step": step, "tokens": tokens, "val_loss": val_loss,
               "val_ppl": val_ppl, "params_total": n_total,
               "params_non_embedding": n_non_emb, "elapsed_s": elapsed,
               "tok_per_s": tokens / max(elapsed, 1e-9), "world_size": dd.world}
    if dd.main:
        write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _groups_json(groups: list[dict]) -> list[dict]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
             if isinstance(v, (int, float, str, bool, list, tuple)) or v is None}
            for g in groups]
