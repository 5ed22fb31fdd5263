"""Several seeds of one config trained as one stacked model, in lockstep.

Legend: K members (runs), B micro_batch, T block_size, P a parameter's own shape.
Why: a small model is launch-bound on a GPU (the study's d=256 rung: 6.5-9.3 ms a step of
2,048 tokens on an H200, MFU < 1%, benchmarks/RESULTS.md, the GPU section): one step of one
seed costs about what one step of K seeds costs when the K seeds' weights are stacked,
(K, *P), and every op of the step runs once over all of them. torch.func.vmap over
functional_call runs the plain model that way (the model code is unchanged and knows nothing
of it); this module keeps the rest of a run per member.

Each member is an ordinary run: its own run dir, config.toml, metrics.jsonl, checkpoints in
a lone run's format (`nlq train --resume DIR` continues one member alone) and summary.json,
with "stack": K in its meta row and summary. The members differ only in train.seed and
data.seed (init and batch order): same model, recipe and step count, so one position and
one lr schedule hold for all. What is exact: a member's gradient is its own (the gradient of
the sum of the members' losses with respect to member k's weights is that of loss k), AdamW
is elementwise and the grad clip is taken per member, as `nlq train` takes it. What is not
bitwise a lone run's: float summation order (batched matrix products, the plain model
instead of the CPU kernels of nlq/model/fast.py): the rounding-level noise a study measures
between machines, so a study trains a rung's runs all stacked or none. Under bf16 autocast
(a GPU's precision) autocast's fp32 policy does not reach ops under vmap: the loss is widened
to fp32 in Stack._loss (as autocast widens a lone run's), attention casts its inputs itself
(nlq/model/transformer.py), and the norms widen their inputs to fp32 (as CUDA autocast runs
layer_norm; the nonlinear query's output LayerNorm and QK-norm see bf16 inputs).

The step boundary (eval, checkpoint, stop) and the final summary are nlq/train/loop.py's,
member by member; the training step, the val loss and the test split run stacked
(nlq/train/stacked.py), the attention logits' range one member at a time through a view of
its weights.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import torch

from nlq.config import Config
from nlq.data.schedule import TokenData
from nlq.errors import NlqError
from nlq.model.params import flops_per_token
from nlq.run import checkpoint, memory
from nlq.train import alloc, dist
from nlq.train.console import PlainLog, peak_memory_mb, progress_bar, stop_on_signals
from nlq.train.loop import Diverged, finish, save_checkpoint, start
from nlq.train.rundir import RunDir, finished, prepare_run_dir
from nlq.train.spikes import flag_spikes
from nlq.train.stacked import Stack, check_stackable


def train_stack(cfgs: list[Config] | None, run_dirs: list[str | Path], resume: bool = False,
                progress: bool = True, tune_alloc: bool = False) -> list[dict]:
    """Train cfgs (equal but for their seeds) into run_dirs as one stacked model, or resume
    the run dirs together (cfgs None: each one's config.toml); returns each run's summary.
    Finished runs are skipped; the others resume together from checkpoints of one step."""
    run_dirs = [Path(d) for d in run_dirs]
    if len(set(map(str, run_dirs))) != len(run_dirs):
        raise NlqError("configs trained as one stack need one run dir each, all different")
    summaries: dict[int, dict] = {}
    if resume:
        for i, d in enumerate(run_dirs):
            s = finished(d, True)
            if s is not None:
                print(f"nlq: {d} already finished at step {s['step']}", file=sys.stderr)
                summaries[i] = s
    todo = [i for i in range(len(run_dirs)) if i not in summaries]
    files = [RunDir(run_dirs[i], True) for i in todo]
    stack, failed = None, True
    try:
        if todo:
            if resume:
                cfgs = [prepare_run_dir(None, f, True) for f in files]
            else:
                cfgs = [cfgs[i] for i in todo]
            check_stackable(cfgs, [str(run_dirs[i]) for i in todo])
            stack = _set_up(cfgs, files, resume, tune_alloc)
            for i, s in zip(todo, _train(stack, resume, progress)):
                summaries[i] = s
            failed = False  # every run started: a diverged one keeps what it wrote
            if stack.dead:
                k, why = next(iter(stack.dead.items()))
                more = f" (and {len(stack.dead) - 1} more)" if len(stack.dead) > 1 else ""
                raise Diverged(f"{run_dirs[todo[k]]}: {why}{more}; the stack's other runs "
                               f"went on; lower train.lr or raise warmup_steps")
        failed = False
        return [summaries[i] for i in range(len(run_dirs))]
    finally:
        for f in files:
            f.close(failed)
        stack = None
        gc.collect()


def _set_up(cfgs: list[Config], files: list[RunDir], resume: bool, tune_alloc: bool) -> Stack:
    """The threads, the device, the memory of K runs, the data (opened and checked once for
    all), the new run dirs claimed, the stack built, then the new runs' config.toml."""
    t = cfgs[0].train
    if t.threads is not None:
        from nlq.sysinfo import check_threads

        torch.set_num_threads(check_threads(t.threads, "train.threads"))
    device = dist.resolve_device(t.device)
    if tune_alloc and device.type == "cpu":
        alloc.keep_freed_memory()
    # K members hold K models' weights, AdamW state and activations: K runs' memory
    memory.check_fits(cfgs[0], device, procs=len(cfgs),
                      gpu_share=int(os.environ.get("NLQ_GPU_SHARE", "1")))
    data = TokenData.open(cfgs[0].data.dir)
    data.check(cfgs[0].model.vocab_size, cfgs[0].model.block_size)
    if not resume:
        for c, f in zip(cfgs, files):
            prepare_run_dir(c, f, False)
    stack = Stack(cfgs, files, device, data, [checkpoint.depends(c) for c in cfgs])
    if not resume:
        for c, f in zip(cfgs, files):
            f.write_config(c)
    return stack


def _train(stack: Stack, resume: bool, progress: bool) -> list[dict | None]:
    """nlq/train/loop.py's _train, member by member at each boundary, one stacked step;
    a diverged member (stack.dead) is left out from its divergence on and gets no summary."""
    members, m0 = stack.members, stack.members[0]
    t = m0.cfg.train
    starts = [start(m, resume, load=stack.load_member) for m in members]
    if len({p.step for p, _ in starts}) != 1:
        steps = ", ".join(f"{m.files.path}: {p.step}" for m, (p, _) in zip(members, starts))
        raise NlqError(f"runs trained as one stack resume together, from checkpoints of one "
                       f"step; theirs are at {steps}: resume them one by one "
                       f"(`nlq train --resume DIR`)")
    stack.load_all()
    pos, fresh = starts[0]
    resumed_at = None if fresh else pos.step
    vals = {k: (float("nan"), float("nan")) for k in range(stack.K)}

    def live():
        return [(k, m) for k, m in enumerate(members) if k not in stack.dead]

    with stop_on_signals() as stop, progress_bar(m0, pos.step, progress) as bar:
        t_last, tokens_last = time.perf_counter(), pos.tokens
        plain = (PlainLog(t.max_steps, pos.step, flops_per_token(m0.cfg.model), m0.device)
                 if bar is None else None)
        while True:
            # -- step boundary: eval, checkpoint, stop (nlq/train/loop.py) ------------------
            boundary = pos.step != resumed_at
            last = pos.step >= t.max_steps
            due = boundary and (pos.step % t.eval_interval == 0 or last)
            if due or (last and not boundary):  # the latter: resumed from the final checkpoint
                vals = dict(enumerate(stack.evaluate()))  # a diverged member's is not used
            if due:
                for k, m in live():
                    m.files.log({"kind": "eval", "step": pos.step, "val_loss": vals[k][0],
                                 "val_ppl": vals[k][1], "tokens": pos.tokens,
                                 "elapsed": pos.elapsed})
                if bar is not None:
                    bar.write(f"step {pos.step}: val loss "
                              f"{', '.join(f'{vals[k][0]:.4f}' for k, _ in live())}")
            signum = stop.signum
            if boundary and pos.step > 0 and (last or pos.step % t.ckpt_interval == 0 or signum):
                for k, m in live():
                    save_checkpoint(m, pos, stack.member_state(k))
            if last:
                break
            if signum:
                dirs = " ".join(str(m.files.path) for _, m in live())
                print(f"nlq: stopped by signal {signum} at step {pos.step}; continue with "
                      f"`nlq train --resume {dirs}`", file=sys.stderr)
                return [None if k in stack.dead else {"status": "interrupted", "step": pos.step}
                        for k in range(stack.K)]

            # -- one optimizer step of every member -----------------------------------------
            t0 = time.perf_counter()
            lr, losses, norms = stack.step(pos.step)
            pos.step += 1
            pos.tokens += t.grad_accum * t.micro_batch * m0.cfg.model.block_size
            pos.elapsed += time.perf_counter() - t0
            if pos.step % t.log_interval == 0 or pos.step == t.max_steps:
                now = time.perf_counter()
                # each member's own tokens: the stack trains K times as many
                tps = (pos.tokens - tokens_last) / max(now - t_last, 1e-9)
                t_last, tokens_last = now, pos.tokens
                for k, m in live():
                    m.files.log({"kind": "train", "step": pos.step, "lr": lr, "loss": losses[k],
                                 "grad_norm": norms[k], "tokens": pos.tokens, "tok_per_s": tps,
                                 "elapsed": pos.elapsed, "peak_mem_mb": peak_memory_mb(m0.device)})
                shown = [losses[k] for k, _ in live()]
                if bar is not None:
                    bar.set_postfix(loss=f"{min(shown):.3f}-{max(shown):.3f}",
                                    tok_s=f"{tps * len(shown):,.0f}")
                elif plain is not None:
                    plain.maybe_print({"step": pos.step, "lr": lr, "loss": shown[0],
                                       "grad_norm": norms[live()[0][0]],
                                       "tok_per_s": tps * len(shown),  # the stack's
                                       "peak_mem_mb": peak_memory_mb(m0.device)})
            for k, m in live():
                flag_spikes(m, pos.step, losses[k], norms[k], f"{m.files.path}: ")
            if bar is not None:
                bar.update(1)
    docs = stack.test_docs() if t.test_eval else [None] * stack.K
    return [None if k in stack.dead else finish(m, pos, *vals[k], test_docs=docs[k])
            for k, m in enumerate(members)]
