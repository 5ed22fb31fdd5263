"""The training loop, read top to bottom in the order things happen.

The recipe (lr schedule, AdamW groups, dropout seeds) is nlq/train/optim.py, grad clip 1.0
here; every arm sees the same batches. train() locks the run dir; set_up()
(nlq/train/setup.py) builds the batches, the model and its optimizer, and only
then is a new run's config.toml written (a start that fails before leaves nothing, see
nlq/train/rundir.py); start() resumes from the latest checkpoint, if any, once the config and
the data are those it records (checkpoint.check_depends). Then, at each step boundary:
evaluate (if due), checkpoint (if due), stop (if done, or asked to by SIGINT / SIGTERM); then
train_step(): grad_accum micro-steps, clip, optimizer step, zero_grad. The final step always
evaluates and saves. Process-wide tuning (nlq/train/alloc.py) is the caller's choice:
`nlq train` asks for it (tune_alloc=True).
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nlq import __version__, runfiles
from nlq.config import Config, model_config_from_dict
from nlq.data.schedule import TokenData
from nlq.errors import NlqError, os_error_text
from nlq.extras import need
from nlq.fsutil import write_atomic
from nlq.model.params import flops_per_token
from nlq.run import checkpoint, memory
from nlq.run.scoring import attention_logit_range, evaluate, evaluate_test
from nlq.run.world import all_reduce_sum
from nlq.sysinfo import check_threads, machine_record
from nlq.train import alloc, dist, init_from
from nlq.train.console import PlainLog, peak_memory_mb, progress_bar, stop_on_signals
from nlq.train.optim import lr_at, make_optimizer, step_seed
from nlq.train.rundir import RunDir, finished, prepare_run_dir, read_run_config
from nlq.train.setup import Run, compile_model, set_up
from nlq.train.spikes import Spikes, flag_spikes

# the recipe and the set-up live beside this loop; their names stay importable from here
__all__ = ["Diverged", "Position", "Run", "compile_model", "lr_at", "make_optimizer",
           "set_up", "step_seed", "train"]


class Diverged(NlqError):
    """A non-finite loss or gradient norm: the run stops, the last good checkpoint stays."""
@dataclass
class Position:
    """Where a run stands: with the weights and AdamW state, what a checkpoint holds."""

    step: int = 0  # optimizer steps taken
    tokens: int = 0
    elapsed: float = 0.0  # seconds spent in train steps, over every process of the run


def train(cfg: Config | None, run_dir: str | Path, resume: bool = False, progress: bool = True,
          tune_alloc: bool = False) -> dict:
    """Train cfg into run_dir, or resume run_dir (cfg None: its config.toml, read once, under
    its lock); returns the summary dict. Under torchrun every rank calls this; rank 0 alone
    writes files. tune_alloc: apply nlq/train/alloc.py's process-wide malloc tuning when the
    run trains on the CPU (`nlq train` asks for it; a library caller's process is its own).

    The set-up, in order, each step once: the config (read on resume), the threads and the
    device, the memory check, train.init_from (a new run), the data dir opened and checked,
    the run dir claimed, what the run depends on (rank 0: the config and the data's hashes),
    then set_up() builds batches, model, wrapping and optimizer, and a new run's config.toml
    is written."""
    run_dir = Path(run_dir)
    main = os.environ.get("RANK", "0") == "0"
    summary = finished(run_dir, main) if resume else None
    if summary is not None:
        print(f"nlq: {run_dir} already finished at step {summary['step']}", file=sys.stderr)
        return summary
    if resume and cfg is None and not main:  # rank 0 reads it under the lock, below
        cfg = read_run_config(run_dir)
    files = RunDir(run_dir, main)
    world, failed = None, True
    try:
        if resume and main:  # claimed first: the config is read under the lock
            cfg = prepare_run_dir(cfg, files, resume)
        if cfg.train.threads is not None:  # the run's summation order is part of its config
            torch.set_num_threads(check_threads(cfg.train.threads, "train.threads"))
        world, device = dist.setup(cfg.train.device)
        if tune_alloc and device.type == "cpu":
            alloc.keep_freed_memory()  # no page faults on per-step buffers (nlq/train/alloc.py)
        if cfg.train.wandb_project and world.main:  # asked for but not installed: say so first
            need("wandb", "train.wandb_project")
        # before anything is allocated or written: a config too large for this machine is
        # one line naming its key, not an allocator traceback minutes later
        memory.check_fits(cfg, device, procs=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                          if device.type == "cpu" else 1,
                          shards=world.size if cfg.train.parallel == "fsdp" else 1,
                          gpu_share=int(os.environ.get("NLQ_GPU_SHARE", "1")))
        # train.init_from is read and checked before a new run dir is made (a bad one leaves
        # nothing behind), and at step 0 only: a resumed run continues from its checkpoint,
        # one stopped before its first checkpoint starts again from step 0 and reads it
        init = (init_from.read(cfg) if not resume or not checkpoint.any_saved(run_dir)
                else None)
        data = TokenData.open(cfg.data.dir)  # opened and checked once, before the run dir
        data.check(cfg.model.vocab_size, cfg.model.block_size)
        if world.main and not resume:
            cfg = prepare_run_dir(cfg, files, resume)
        depends = checkpoint.depends(cfg) if world.main else None
        run = set_up(cfg, files, world, device, init, data, depends)
        del init  # its tensors are the model's now
        if world.main and not resume:
            files.write_config(cfg)  # the run exists from here: it is set up
        summary = _train(run, resume, progress)
        failed = False
        return summary
    except torch.OutOfMemoryError as e:  # one line, not an allocator traceback
        first = " ".join(str(e).split())[:160]
        kept = ("its checkpoints are kept: " if checkpoint.any_saved(run_dir) else "")
        raise NlqError(f"out of memory in run {run_dir} ({first}): {kept}lower "
                       f"train.micro_batch (raise train.grad_accum to keep the batch), or run "
                       f"fewer jobs on this device, then run it again") from None
    except OSError as e:  # metrics, tb events or summary.json on a full or read-only disk
        try:
            kept = checkpoint.any_saved(run_dir)
        except OSError:  # e.g. a run dir path too long to look into
            kept = False
        then = (f"; its checkpoints are kept: then `nlq train --resume {run_dir}`" if kept
                else "")
        raise NlqError(f"I/O error in run {run_dir}: {os_error_text(e)}{then}") from None
    finally:
        files.close(failed)  # a new run that failed before it was set up leaves nothing
        # The DDP model goes before the process group: freed after destroy_process_group, its
        # reducer's gloo group is destroyed holding the GIL while its worker thread waits for
        # the GIL to free the barrier's tensors, a deadlock at exit (seen under torchrun). The
        # model sits in reference cycles, so dropping the name is not enough: collect them.
        run = None
        gc.collect()
        if world is not None:
            dist.teardown(world)


def _train(run: Run, resume: bool, progress: bool) -> dict:
    """Start (or resume), then step boundaries and optimizer steps until the last boundary."""
    t, world, files = run.cfg.train, run.world, run.files
    pos, fresh = start(run, resume)
    resumed_at = None if fresh else pos.step  # its boundary was done before the checkpoint
    val_loss = val_ppl = float("nan")
    with stop_on_signals() as stop, progress_bar(run, pos.step, progress) as bar:
        t_last, tokens_last = time.perf_counter(), pos.tokens
        plain = (PlainLog(t.max_steps, pos.step, flops_per_token(run.cfg.model), run.device)
                 if world.main and bar is None else None)
        while True:
            # -- step boundary: eval, checkpoint, stop -----------------------------------------
            boundary = pos.step != resumed_at
            last = pos.step >= t.max_steps
            if last and not boundary:  # resumed from the final checkpoint: recompute only
                val_loss, val_ppl = evaluate(run.wrapped, run.batches, world, run.autocast)
            if boundary and (pos.step % t.eval_interval == 0 or last):
                val_loss, val_ppl = evaluate(run.wrapped, run.batches, world, run.autocast)
                if world.main:
                    files.log({"kind": "eval", "step": pos.step, "val_loss": val_loss,
                               "val_ppl": val_ppl, "tokens": pos.tokens, "elapsed": pos.elapsed})
                    if bar is not None:
                        bar.write(f"step {pos.step}: val loss {val_loss:.4f}, ppl {val_ppl:.2f}")
            # a signal that reached any rank stops every rank at this same boundary
            signum = dist.max_over_ranks(stop.signum, world, run.device)
            # never at step 0: there is nothing to keep, and a checkpoint without optimizer
            # state would resume with a differently initialised AdamW (torch's
            # set_optimizer_state_dict fills empty state with a step-1 state)
            if boundary and pos.step > 0 and (last or pos.step % t.ckpt_interval == 0 or signum):
                save_checkpoint(run, pos)
            if last:
                break
            if signum:
                if world.main:
                    print(f"nlq: stopped by signal {signum} at step {pos.step}; continue "
                          f"with `nlq train --resume {files.path}`", file=sys.stderr)
                return {"status": "interrupted", "step": pos.step}

            # -- one optimizer step ------------------------------------------------------------
            t0 = time.perf_counter()
            lr, train_loss, grad_norm = train_step(run, pos.step)
            pos.step += 1
            pos.tokens += t.grad_accum * t.micro_batch * run.cfg.model.block_size
            pos.elapsed += time.perf_counter() - t0
            if world.main and (pos.step % t.log_interval == 0 or pos.step == t.max_steps):
                now = time.perf_counter()
                tps = (pos.tokens - tokens_last) / max(now - t_last, 1e-9)
                t_last, tokens_last = now, pos.tokens
                rec = {"kind": "train", "step": pos.step, "lr": lr, "loss": train_loss,
                       "grad_norm": grad_norm, "tokens": pos.tokens, "tok_per_s": tps,
                       "elapsed": pos.elapsed, "peak_mem_mb": peak_memory_mb(run.device)}
                files.log(rec)
                if bar is not None:
                    bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tps:,.0f}")
                elif plain is not None:
                    plain.maybe_print(rec)
            flag_spikes(run, pos.step, train_loss, grad_norm)
            if bar is not None:
                bar.update(1)
    return finish(run, pos, val_loss, val_ppl)


def start(run: Run, resume: bool, load=None) -> tuple[Position, bool]:
    """Where the run starts, and whether it starts afresh at step 0: a resumed run loads its
    latest checkpoint (load(run, model_sd, optim_sd): where its full state dicts go; default
    the model and optimizer of the run, under any parallelism). Opens the logs (a resumed
    run's cut back to its checkpoint) and writes a fresh run's meta row."""
    cfg, world, run_dir = run.cfg, run.world, run.files.path
    pos, metrics_offset = Position(), None
    fresh = not resume or not checkpoint.any_saved(run_dir)
    if world.main and cfg.train.warmup >= cfg.train.max_steps - 1:
        how = ("warmup_steps" if cfg.train.warmup_steps is not None
               else "the default warmup, max(50, max_steps // 20)")
        print(f"nlq: warning: {run_dir}: {how} = {cfg.train.warmup} covers all "
              f"{cfg.train.max_steps} steps: the lr never reaches train.lr nor decays to "
              f"train.min_lr (set train.warmup_steps below max_steps)", file=sys.stderr)
    if resume and fresh:
        # stopped before its first checkpoint: starting over from step 0 is exact (init,
        # batches and masks are functions of the config), so that is what resuming means
        metrics_offset = 0
        if world.main:
            print(f"nlq: warning: {run_dir} has no checkpoint yet; starting it again from "
                  f"step 0", file=sys.stderr)
    elif resume:
        ck = checkpoint.load_latest(run_dir)
        if world.main:  # the config and the data it was trained on, unchanged
            for warning in checkpoint.check_depends(ck, run.depends, run_dir):
                print(f"nlq: warning: {warning}", file=sys.stderr)
        if not isinstance(ck.state.get("depends"), dict):  # an older nlq's: its model only
            saved = ck.state.get("model_config")
            # read as a config (an old checkpoint's nl_* keys are query_args now), compared
            if not isinstance(saved, dict) or model_config_from_dict(saved) != cfg.model:
                raise NlqError(f"checkpoint {ck.path} was written for another model config "
                               f"than {run_dir / runfiles.CONFIG}")
        sd = dict(ck.model)
        if cfg.model.tie_embeddings:
            sd["lm_head.weight"] = sd["wte.weight"]
        load = load or (lambda r, m, o: dist.load_full_state(r.wrapped, r.optimizer, m, o))
        try:
            load(run, sd, checkpoint.flat_to_optim(ck.optim, ck.state["param_groups"]))
        except (RuntimeError, KeyError, ValueError) as e:
            why = " ".join(str(e).split())  # load_state_dict's message spans lines
            raise NlqError(f"checkpoint {ck.path} does not fit this model: {why}") from None
        pos = Position(ck.state["step"], ck.state["tokens"], ck.state["elapsed"])
        run.spikes = Spikes(ck.state.get("spikes"))
        metrics_offset = ck.state["metrics_bytes"]
    if world.main:
        run.files.open_logs(metrics_offset, pos.step)
        if cfg.train.wandb_project:
            run.files.open_wandb(cfg.train.wandb_project, cfg.to_dict())
        if fresh:
            init = {"init_from": run.init} if run.init else {}
            stack = {"stack": run.stack} if run.stack else {}
            run.files.log({"kind": "meta", "step": 0, **run.params, "nlq_version": __version__,
                           "world_size": world.size, "device": str(run.device),
                           **machine_record(), **init, **stack})
    return pos, fresh


def train_step(run: Run, step: int) -> tuple[float, float, float]:
    """Optimizer step `step` (0-based): this rank's micro-steps, clip, one AdamW step.
    Returns (lr, train loss averaged over all ranks, grad norm); a non-finite loss or grad
    norm raises Diverged before the optimizer step."""
    t, world, micros = run.cfg.train, run.world, run.batches.micros
    lr = lr_at(step, t)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    torch.manual_seed(step_seed(t.seed, step, world.rank))
    loss_sum = torch.zeros((), device=run.device)
    # a masked LM's weights need every micro-batch's targets first: fetched once, up front
    ready = ([run.batches.train(step, m) for m in micros] if run.batches.objective == "mlm"
             else None)
    weights = mlm_weights(run, [y for _, y in ready]) if ready else None
    for i, micro in enumerate(micros):
        x, y = ready[i] if ready else run.batches.train(step, micro)
        with dist.grad_sync(run.wrapped, t.parallel, world, sync=i == len(micros) - 1):
            with run.autocast:
                _, loss = run.wrapped(x, y, prefix_len=run.batches.prefix_len)
            # mean over this rank's micro-steps; DDP/FSDP average over ranks. A masked LM's
            # micro-batches hold different numbers of targets: each is weighed by its share
            # of the step's, so the step is the token mean whatever the micro-batch split
            (loss / len(micros) if weights is None else loss * weights[i]).backward()
        loss_sum += loss.detach() if weights is None else loss.detach() * weights[i]
    clip = t.grad_clip if t.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(run.wrapped.parameters(), clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                      else grad_norm)
    mean = loss_sum / len(micros) if weights is None else loss_sum  # this rank's share
    train_loss = all_reduce_sum(mean, world).item() / world.size
    if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
        kept = (f"the last good checkpoint in {run.files.path / 'ckpt'} is kept"
                if checkpoint.any_saved(run.files.path) else "no checkpoint was written yet")
        raise Diverged(  # step + 1: the step being computed, as metrics count steps
            f"training diverged at step {step + 1}: loss {train_loss}, grad norm "
            f"{grad_norm} (lr {lr:.3g}); {kept}: lower train.lr or raise warmup_steps")
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return lr, train_loss, grad_norm


def mlm_weights(run: Run, targets: list[torch.Tensor]) -> list[float]:
    """Per micro-step of this rank (targets: its micro-batches' targets, -1 = none), the weight
    of its mean loss that makes the step the mean over all the step's masked targets (all
    ranks): its targets / the step's, times the world size (DDP/FSDP average the ranks'
    gradients)."""
    counts = [float((y >= 0).sum()) for y in targets]
    total = all_reduce_sum(torch.tensor(sum(counts), dtype=torch.float64, device=run.device),
                           run.world).item()
    return [c * run.world.size / max(total, 1.0) for c in counts]


def save_checkpoint(run: Run, pos: Position, state_dicts: tuple[dict, dict] | None = None) -> None:
    """Full weights and AdamW state (gathering them is a collective under FSDP) with the
    position, written by rank 0 (nlq/run/checkpoint.py). state_dicts: the full (model,
    optimizer) state dicts where the caller has them (a stacked run's member,
    nlq/train/stacked.py)."""
    model_sd, optim_sd = state_dicts or dist.full_state(run.wrapped, run.optimizer)
    if not run.world.main:
        return
    cfg = run.cfg
    if cfg.model.tie_embeddings:
        model_sd.pop("lm_head.weight", None)  # safetensors stores no aliases
    state = {"step": pos.step, "tokens": pos.tokens, "elapsed": pos.elapsed,
             "metrics_bytes": run.files.metrics_bytes(), "model_config": cfg.to_dict()["model"],
             "param_groups": checkpoint.groups_json(optim_sd["param_groups"]),
             "world_size": run.world.size, "nlq_version": __version__,
             "rng": "derived: dropout reseeded from (train.seed, step, rank)",
             "spikes": run.spikes.state(), "depends": run.depends}
    checkpoint.save(run.files.path, pos.step, {k: v.contiguous() for k, v in model_sd.items()},
                    checkpoint.optim_to_flat(optim_sd), state, cfg.train.keep_checkpoints,
                    on_stage=run.fault_hooks and run.fault_hooks.checkpoint_stage)


def finish(run: Run, pos: Position, val_loss: float, val_ppl: float,
           test_docs: dict | None = None) -> dict:
    """The summary of a finished run, written to summary.json by rank 0, with the spikes and,
    when train.test_eval, the whole test split's loss (per document in test_docs.json;
    test_docs: evaluate_test's result where the caller scored it, a stack's member)."""
    summary = {"status": "finished", "step": pos.step, "tokens": pos.tokens,
               "val_loss": val_loss, "val_ppl": val_ppl, **run.params,
               "elapsed_s": pos.elapsed, "tok_per_s": pos.tokens / max(pos.elapsed, 1e-9),
               "world_size": run.world.size, "warmup_steps": run.cfg.train.warmup,
               # what summed its floats: the same config gives the same bits only on the
               # same ISA at the same thread count (a resumed run: where it finished)
               **machine_record(),
               "n_spikes": len(run.spikes.found), "spikes": run.spikes.found}
    if run.stack:  # trained in a stack of that many seeds as one model (nlq/train/stack.py)
        summary["stack"] = run.stack
    if run.cfg.train.test_eval:
        docs = test_docs or evaluate_test(run.wrapped, run.batches, run.world, run.autocast)
        test_loss = sum(docs["nats"]) / sum(docs["tokens"])
        summary |= {"test_loss": test_loss, "test_ppl": math.exp(min(test_loss, 700.0)),
                    "test_tokens": sum(docs["tokens"]), "test_docs": len(docs["doc"])}
        if run.world.main:
            write_atomic(run.files.path / runfiles.TEST_DOCS, json.dumps(docs))
    # the attention logits' range per layer (the QK-norm arms' bounded logits: README, "The
    # study"); after the test split, so nothing scored depends on it
    logit_range = attention_logit_range(run.wrapped, run.batches, run.autocast)
    if logit_range is not None:
        summary["attn_logits"] = logit_range
    if run.world.main:
        write_atomic(run.files.path / runfiles.SUMMARY, json.dumps(summary, indent=2))
    return summary
