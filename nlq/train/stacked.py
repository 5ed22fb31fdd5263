"""The stacked weights of seeds trained as one model (nlq/train/stack.py runs them).

Legend: K members (runs), B micro_batch, T block_size, P a parameter's own shape.
Stack holds every parameter of the K members' models as one (K, *P) leaf tensor, one AdamW
over them (elementwise: each member's slice is updated as its own AdamW would update it), the
member runs, and the stacked training step: torch.func.vmap of the plain model's
functional_call over K, the sum of the members' losses backward (the gradient with respect to
member k's weights is that of its own loss), a grad clip per member; the val loss and the
test split stacked alike (evaluate, test_docs). Member is one member as a model, for what
runs one member at a time (the attention logits' range). Checkpoints are written and read
member by member in a lone run's format (member_state, load_member / load_all).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

from nlq.config import Config
from nlq.config.load import flatten
from nlq.data.schedule import TokenData
from nlq.errors import NlqError
from nlq.model import Transformer
from nlq.model.layers import RMSNorm
from nlq.run.batches import Batches
from nlq.run.scoring import score_test
from nlq.run.world import World
from nlq.train.loop import Diverged, lr_at, mlm_weights
from nlq.train.optim import make_optimizer
from nlq.train.rundir import RunDir
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


def _widen(_module, args):
    """A norm's input in fp32 under autocast, as CUDA autocast runs layer_norm (and rms_norm's
    pow and rsqrt) in fp32 for a lone run: its fp32 policy never runs under vmap (a bf16
    cross-entropy was seen there on CPU), so a stack widens a norm's input itself. (CPU autocast
    leaves layer_norm in bf16 for a lone run: on a CPU in bf16 the stack's norms are wider.)"""
    x = args[0]
    if x.dtype in (torch.bfloat16, torch.float16) and torch.is_autocast_enabled(x.device.type):
        return (x.float(), *args[1:])
    return None


class Member(torch.nn.Module):
    """Member k of a stack as a model: forward(...) is the plain model's, with member k's
    weights (views of the stacked tensors); what runs one member at a time calls it (the
    attention logits' range, nlq/run/scoring.py). base: the architecture, on the meta device."""

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
        self._names = {id(p): n for n, p in self.params.items()}  # the optimizer's tensors
        # the architecture alone, its tied head kept tied: functional_call swaps a member's
        # tensors in for each call
        with torch.device("meta"):
            self.base = Transformer(cfgs[0].model, seed=cfgs[0].train.seed)
        self.base.chunked_loss = False  # the plain loss: vmap cannot batch the chunked one
        for m in self.base.modules():
            if isinstance(m, (torch.nn.LayerNorm, RMSNorm)):
                m.register_forward_pre_hook(_widen)
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

    def _nats(self, params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor):
        """One member's sum of nats on (B, T) inputs and targets (vmap maps it over K): the
        model's logits, the cross-entropy over the targets that carry a loss (-1: none) in
        fp32. Widened here because autocast's fp32 ops never run under vmap (checked on CPU:
        cross-entropy of bf16 logits stayed bf16), where a lone run's loss is fp32."""
        prefix_len = self.members[0].batches.prefix_len
        logits, _ = functional_call(self.base, (params, buffers), (x,),
                                    {"prefix_len": prefix_len})  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(),  # (B*T, V), (B*T,)
                               ignore_index=-1, reduction="sum")

    def _loss(self, params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor):
        """One member's mean loss: _nats over the targets that carry a loss."""
        return self._nats(params, buffers, x, y) / (y != -1).sum().clamp(min=1)

    @torch.no_grad()
    def evaluate(self) -> list[tuple[float, float]]:
        """Each member's (val loss, val perplexity), as nlq/run/scoring.py's evaluate gives a
        lone run's (its sum of nats over its fixed val windows' target tokens, summed in
        float64), with the members' chunks stacked, (K, B, T): one vmapped forward a chunk
        instead of K (members have val windows of their own: data.seed draws them)."""
        m0 = self.members[0]
        nats = torch.zeros(self.K, dtype=torch.float64, device=m0.device)
        count = torch.zeros(self.K, dtype=torch.float64, device=m0.device)
        self.base.eval()
        for i in range(m0.batches.val.shape[0]):
            xs, ys = zip(*(m.batches.val_chunk(i) for m in self.members))
            x, y = torch.stack(xs), torch.stack(ys)  # (K, B, T) each
            with m0.autocast:
                nats += vmap(self._nats)(self.params, self.buffers, x, y).double()  # (K,)
            count += (y >= 0).sum((1, 2))
        self.base.train()
        return [(v, math.exp(min(v, 700.0))) for v in (nats / count).tolist()]

    @torch.no_grad()
    def test_docs(self) -> list[dict]:
        """Each member's test split, as evaluate_test (nlq/run/scoring.py) scores a lone run's:
        the members share the test windows, so each chunk is one vmapped forward over the
        stacked weights."""
        m0 = self.members[0]

        def token_nats(params, buffers, x, y, mask):  # (b, T) -> (b, T) nats, fp32 as in _nats
            logits, _ = functional_call(self.base, (params, buffers), (x,),
                                        {"prefix_len": m0.batches.prefix_len,
                                         "attn_mask": mask})  # (b, T, V)
            return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(),  # (b*T, V)
                                   ignore_index=-1, reduction="none").view(y.shape)

        def score(x, y, mask):  # (b, T) -> (K, b, T)
            return vmap(token_nats, in_dims=(0, 0, None, None, None))(
                self.params, self.buffers, x, y, mask)

        self.base.eval()
        try:
            return score_test(score, self.K, m0.batches, m0.world, m0.autocast)
        finally:
            self.base.train()

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
        names = self._names
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
        names = self._names
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
        weights = ready = None
        if m0.batches.objective == "mlm":  # per member, as a lone run's (nlq/train/loop.py)
            ready = [[m.batches.train(step, micro) for m in self.members] for micro in micros]
            weights = torch.tensor([mlm_weights(m, [r[k][1] for r in ready])
                                    for k, m in enumerate(self.members)],
                                   dtype=torch.float32, device=m0.device).T  # (micros, K)
        for i, micro in enumerate(micros):
            xs, ys = zip(*(ready[i] if ready else
                           (m.batches.train(step, micro) for m in self.members)))
            x, y = torch.stack(xs), torch.stack(ys)  # (K, B, T) each
            with m0.autocast:
                losses = vmap(self._loss)(self.params, self.buffers, x, y)  # (K,)
            # the sum: d(sum)/d(member k's weights) = d(loss k)/d(them)
            if weights is None:
                (losses.sum() / len(micros)).backward()
                loss_sum += losses.detach().float()
            else:
                (losses * weights[i]).sum().backward()
                loss_sum += losses.detach().float() * weights[i]
        grad_norms = self._clip(t.grad_clip if t.grad_clip > 0 else float("inf"))
        train_losses = (loss_sum / len(micros) if weights is None else loss_sum).tolist()
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
            # a diverged member's gradients are zeroed; AdamW's momentum and decay still move
            # its slot, but it is never saved or summarised again
            for k in self.dead:
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
