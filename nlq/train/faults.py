"""Fault injection for the crash tests (tests/test_resume.py, tests/robustness/).

NLQ_FAULT="POINT@N" acts the N-th time (1-based) a training run reaches POINT:
    step          after its N-th optimizer step                          -> SIGKILL itself
    eval          after the N-th forward of an evaluation (one per val chunk)     -> SIGKILL
    ckpt_model, ckpt_optim, ckpt_state, ckpt_rename, ckpt_latest
                  after that stage of its N-th checkpoint write (checkpoint.save) -> SIGKILL
    nan           the N-th optimizer step's loss is NaN (its gradients stay finite)
    oom           the N-th optimizer step's forward raises torch.OutOfMemoryError, as a GPU
                  out of memory does (faked on any device)
Several specs may be joined with commas, e.g. NLQ_FAULT="nan@5,ckpt_state@2".

None of this is in the training loop's code. from_env() reads NLQ_FAULT once when a run is
set up and returns None when it is unset (always, outside tests); when it is set, the loop
calls attach() once, which hooks the model's forward and the optimizer's step, and hands
checkpoint_stage to checkpoint.save, which calls it between the stages of a write.
"""

from __future__ import annotations

import os
import signal

import torch

from nlq.errors import NlqError

CKPT_STAGES = ("ckpt_model", "ckpt_optim", "ckpt_state", "ckpt_rename", "ckpt_latest")
POINTS = ("step", "eval", "nan", "oom", *CKPT_STAGES)


class Faults:
    """The armed points of one run and how often each was reached."""

    def __init__(self, armed: dict[str, int]):
        self.armed = armed
        self.seen = dict.fromkeys(POINTS, 0)
        self.step_started = False  # a training forward of the current step was seen

    def hit(self, point: str) -> bool:
        """Count a visit to `point`; SIGKILL at an armed kill point; True at an armed 'nan'."""
        self.seen[point] += 1
        if self.armed.get(point) != self.seen[point]:
            return False
        if point == "nan":
            return True
        if point == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB "
                                         "(injected by NLQ_FAULT)")
        os.kill(os.getpid(), signal.SIGKILL)
        return False  # pragma: no cover

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Hook the points of a step and an evaluation onto the model and the optimizer."""
        model.register_forward_hook(self._after_forward)
        optimizer.register_step_post_hook(self._after_step)

    def checkpoint_stage(self, stage: str) -> None:
        """Called by checkpoint.save after each stage of a write (CKPT_STAGES)."""
        self.hit(stage)

    def _after_step(self, _optimizer, _args, _kwargs) -> None:
        self.step_started = False
        self.hit("step")

    def _after_forward(self, module, _args, output):
        if not module.training:
            self.hit("eval")
            return None
        if self.step_started:  # 'nan' counts steps: only a step's first micro-step
            return None
        self.step_started = True
        self.hit("oom")
        if not self.hit("nan"):
            return None
        logits, loss = output
        return logits, loss + float("nan")  # the gradients are those of the finite loss


def from_env() -> Faults | None:
    """The faults NLQ_FAULT arms, or None where it is unset."""
    spec = os.environ.get("NLQ_FAULT")
    if spec is None:
        return None
    armed = {}
    for part in filter(None, spec.split(",")):
        name, _, n = part.partition("@")
        name, n = name.strip(), n.strip() or "1"
        if name not in POINTS or not n.isdigit():
            raise NlqError(f"NLQ_FAULT: {part!r} is not POINT@N with POINT one of "
                           f"{', '.join(POINTS)}")
        armed[name] = int(n)
    return Faults(armed)
