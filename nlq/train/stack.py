"""Several seeds of one config trained as one stacked model, in lockstep.

Legend: K members (runs), B micro_batch, T block_size, P a parameter's own shape.
Why: a small model is launch-bound on a GPU (an R1-sized run reached 0.3% MFU on an H200,
docs/experiments.md): one step of one seed costs about what one step of K seeds costs when
the K seeds' weights are stacked, (K, *P), and every op of the step runs once over all of
them. torch.func.vmap over functional_call runs the plain model that way (the model code is
unchanged and knows nothing of it); this module keeps the rest of a run per member.

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
to fp32 here (as autocast widens a lone run's), attention casts its inputs itself
(nlq/model/transformer.py), and a norm of a bf16 input (the nonlinear query's output
LayerNorm, QK-norm) runs in bf16 where CUDA autocast would run it in fp32.

The step boundary (eval, checkpoint, stop) and the final summary are nlq/train/loop.py's,
member by member: eval and the test split run one member at a time through a view of its
weights (Member); only the training step is stacked.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

from nlq.config import Config
from nlq.config.load import flatten
from nlq.data.schedule import TokenData
from nlq.errors import NlqError
from nlq.model import Transformer
from nlq.model.params import flops_per_token
from nlq.run import checkpoint, memory
from nlq.run.batches import Batches
from nlq.run.scoring import evaluate
from nlq.run.world import World
from nlq.train import alloc, dist
from nlq.train.console import PlainLog, peak_memory_mb, progress_bar, stop_on_signals
from nlq.train.loop import Diverged, finish, lr_at, save_checkpoint, start
from nlq.train.optim import make_optimizer
from nlq.train.rundir import RunDir, finished, prepare_run_dir
from nlq.train.setup import Run
from nlq.train.spikes import Spikes

# what may differ between the members of a stack: the init seed and the data order
MEMBER_KEYS = ("train.seed", "data.seed")


def check_stackable(cfgs: list[Config], names: list[str]) -> None:
    """Raise NlqError unless cfgs can train as one stacked model: equal but for MEMBER_KEYS,
    one process, nothing the stacked step does not do as a lone run does."""
    first = flatten(cfgs[0].to_dict())
    for cfg, name in zip(cfgs[1:], names[1:]):
        other = flatten(cfg.to_dict())
        diff = sorted(k for k in first.keys() | other.keys()
                      if k not in MEMBER_KEYS and first.get(k) != other.get(k))
        if diff:
            k = diff[0]
            raise NlqError(f"configs trained as one stack may differ only in "
                           f"{' and '.join(MEMBER_KEYS)}: {k} is {first.get(k)!r} for {names[0]} "
                           f"and {other.get(k)!r} for {name}")
    t, m = cfgs[0].train, cfgs[0].model
    why = {"train.compile": t.compile,  # vmap runs the eager model
           # vmap draws other dropout masks than a lone run: the members would not be the
           # runs their configs describe
           "model.dropout": m.dropout > 0,
           "train.init_from": t.init_from is not None,
           "train.wandb_project": t.wandb_project is not None}  # one W&B run per process
    bad = [k for k, v in why.items() if v]
    if bad:
        raise NlqError(f"{bad[0]} is not supported for configs trained as one stack: train "
                       f"them one by one (one config per `nlq train`)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise NlqError("configs trained as one stack run in one process, not under torchrun: "
                       "train them one by one there")


class Member(torch.nn.Module):
    """Member k of a stack as a model: forward(...) is the plain model's, with member k's
    weights (views of the stacked tensors). What eval, the test split and the attention
    logits' range call (nlq/run/scoring.py); base is the architecture, on the meta device."""

    def __init__(self, base: Transformer, params: dict, buffers: dict, k: int):
        super().__init__()
        self.base, self.k = base, k
        self._params, self._buffers_k = params, buffers  # not registered: the stack's own

    def forward(self, *args, **kwargs):
        k = self.k
        state = ({n: p[k] for n, p in self._params.items()},
                 {n: b[k] for n, b in self._buffers_k.items()})
        return functional_call(self.base, state, args, kwargs)


class Stack:
    """The stacked weights (name -> (K, *P) leaves), their AdamW, and the member runs."""

    def __init__(self, cfgs: list[Config], files: list[RunDir], device: torch.device,
                 data: TokenData, depends: list[dict]):
        t = cfgs[0].train
        world = World()
        models = [Transformer(c.model, seed=c.train.seed) for c in cfgs]  # init as lone runs
        self.params, self.buffers = stack_module_state(models)  # name -> (K, *P)
        self.params = {n: p.to(device).detach().requires_grad_() for n, p in self.params.items()}
        self.buffers = {n: b.to(device) for n, b in self.buffers.items()}
        # the architecture alone, its tied head kept tied: functional_call swaps a member's
        # tensors in for each call
        with torch.device("meta"):
            self.base = Transformer(cfgs[0].model, seed=cfgs[0].train.seed)
        self.base.chunked_loss = False  # the plain loss: vmap cannot batch the chunked one
        counts = {"params_total": models[0].num_params(),
                  "params_non_embedding": models[0].num_params(non_embedding=True)}
        self.optimizer = make_optimizer(models[0], t, device, self.params)
        del models
        bf16 = t.precision == "bf16" or (t.precision == "auto" and device.type == "cuda")
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16
                    else contextlib.nullcontext())
        self.members = [
            Run(c, world, device, f, Batches(c, world, device, data),
                Member(self.base, self.params, self.buffers, k), self.optimizer, autocast, None,
                counts, Spikes(), depends=d, stack=len(cfgs))
            for k, (c, f, d) in enumerate(zip(cfgs, files, depends))]
        self._loaded: dict[int, tuple[dict, dict]] = {}
        self.dead: dict[int, str] = {}  # diverged members: why

    @property
    def K(self) -> int:
        return len(self.members)

    def _loss(self, params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor):
        """One member's mean loss on (B, T) inputs and targets (vmap maps it over K): the
        model's logits, the cross-entropy over the targets that carry a loss (-1: none) in
        fp32. Widened here because autocast's fp32 ops never run under vmap (checked on CPU:
        cross-entropy of bf16 logits stayed bf16), where a lone run's loss is fp32."""
        prefix_len = self.members[0].batches.prefix_len
        logits, _ = functional_call(self.base, (params, buffers), (x,),
                                    {"prefix_len": prefix_len})  # (B, T, V)
        nats = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(),  # (B*T, V), (B*T,)
                               ignore_index=-1, reduction="sum")
        return nats / (y != -1).sum().clamp(min=1)

    # -- checkpoints: a lone run's state dicts, member by member ---------------------------
    def load_member(self, run: Run, model_sd: dict, optim_sd: dict) -> None:
        """loop.start's load: kept until every member has loaded (load_all)."""
        self._loaded[self.members.index(run)] = (model_sd, optim_sd)

    def load_all(self) -> None:
        """Stack the members' loaded state dicts into the weights and the AdamW state."""
        if not self._loaded:
            return
        with torch.no_grad():
            for n, p in self.params.items():
                for k, (model_sd, _) in self._loaded.items():
                    if n not in model_sd or model_sd[n].shape != p.shape[1:]:
                        raise NlqError(f"checkpoint of {self.members[k].files.path} does not "
                                       f"fit this model: {n} missing or reshaped")
                    p[k].copy_(model_sd[n])
        names = {id(p): n for n, p in self.params.items()}
        state, groups, i = {}, [], 0
        for g in self.optimizer.param_groups:
            ids = []
            for p in g["params"]:
                per = [o["state"][names[id(p)]] for _, (_, o) in sorted(self._loaded.items())]
                steps = {float(s["step"]) for s in per}
                if len(steps) != 1:
                    raise NlqError(f"the members' AdamW states are at different steps "
                                   f"({sorted(steps)}) for {names[id(p)]}")
                state[i] = {"step": per[0]["step"],  # (K, *P) moments, one step count
                            "exp_avg": torch.stack([s["exp_avg"] for s in per]),
                            "exp_avg_sq": torch.stack([s["exp_avg_sq"] for s in per])}
                ids.append(i)
                i += 1
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self._loaded.clear()

    def member_state(self, k: int) -> tuple[dict, dict]:
        """Member k's full model and optimizer state dicts, as dist.full_state gives a lone
        run's (keyed by parameter name, on the CPU)."""
        model_sd = {n: p[k].detach().cpu() for n, p in self.params.items()}
        names = {id(p): n for n, p in self.params.items()}
        state, groups = {}, []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                s = self.optimizer.state.get(p)
                if s:
                    state[names[id(p)]] = {"step": s["step"].detach().cpu(),
                                           "exp_avg": s["exp_avg"][k].detach().cpu(),
                                           "exp_avg_sq": s["exp_avg_sq"][k].detach().cpu()}
            groups.append({**{key: v for key, v in g.items() if key != "params"},
                           "params": [names[id(p)] for p in g["params"]]})
        return model_sd, {"state": state, "param_groups": groups}

    # -- one optimizer step of every member ---------------------------------------------
    def step(self, step: int) -> tuple[float, list[float], list[float]]:
        """Optimizer step `step` of every member: the micro-steps on the stacked batches
        (K, B, T), the grad clip per member, one AdamW step. Returns (lr, train losses,
        grad norms), one per member. A member whose loss or grad norm is not finite is
        diverged (self.dead) and left out from then on; all of them raises Diverged."""
        m0 = self.members[0]
        t, micros = m0.cfg.train, m0.batches.micros
        lr = lr_at(step, t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros(self.K, device=m0.device)
        for micro in micros:
            xs, ys = zip(*(m.batches.train(step, micro) for m in self.members))
            x, y = torch.stack(xs), torch.stack(ys)  # (K, B, T) each
            with m0.autocast:
                losses = vmap(self._loss)(self.params, self.buffers, x, y)  # (K,)
            # the sum: d(sum)/d(member k's weights) = d(loss k)/d(them)
            (losses.sum() / len(micros)).backward()
            loss_sum += losses.detach().float()
        grad_norms = self._clip(t.grad_clip if t.grad_clip > 0 else float("inf"))
        train_losses = (loss_sum / len(micros)).tolist()
        norms = grad_norms.tolist()
        for k, (loss, gn) in enumerate(zip(train_losses, norms)):
            if k not in self.dead and not (math.isfinite(loss) and math.isfinite(gn)):
                # as a lone run stops (nlq/train/loop.py): no step taken, its last good
                # checkpoint kept; the others go on (their gradients are their own)
                self.dead[k] = (f"training diverged at step {step + 1}: loss {loss}, grad norm "
                                f"{gn} (lr {lr:.3g})")
                print(f"nlq: {self.members[k].files.path}: {self.dead[k]}; its last good "
                      f"checkpoint is kept, the stack's other runs go on", file=sys.stderr)
        if len(self.dead) == self.K:
            raise Diverged(f"every run of the stack diverged (the last at step {step + 1}, lr "
                           f"{lr:.3g}): lower train.lr or raise warmup_steps")
        with torch.no_grad():
            for k in self.dead:  # a diverged member's weights stop changing
                for p in self.params.values():
                    if p.grad is not None:
                        p.grad[k].zero_()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr, train_losses, norms

    def _clip(self, max_norm: float) -> torch.Tensor:
        """clip_grad_norm_ per member: each member's total grad norm (K,), from the norms of
        its slices, and its gradients scaled by min(1, max_norm / (norm + 1e-6)), as torch's
        clip_grad_norm_ scales a lone run's."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        per = torch.stack([torch.linalg.vector_norm(g.reshape(self.K, -1), dim=1)
                           for g in grads])  # (n_params, K)
        norms = torch.linalg.vector_norm(per, dim=0)  # (K,)
        coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)  # (K,)
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))  # (K, 1, ...)
        return norms


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
                vals = {k: evaluate(m.wrapped, m.batches, m.world, m.autocast)
                        for k, m in live()}
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
                for spike in m.spikes.update(pos.step, losses[k], norms[k]):
                    m.files.log({"kind": "spike", "step": spike["step"], "of": spike["kind"],
                                 "value": spike["value"], "ref": spike["ref"]})
                    print(f"nlq: warning: {m.files.path}: {spike['kind']} spike at step "
                          f"{spike['step']}: {spike['value']:.4g} vs running median "
                          f"{spike['ref']:.4g}", file=sys.stderr)
            if bar is not None:
                bar.update(1)
    return [None if k in stack.dead else finish(m, pos, *vals[k]) for k, m in enumerate(members)]
