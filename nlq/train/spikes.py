"""Loss spikes, flagged where they happen.

A step is a spike when its train loss is above LOSS_RATIO x the median train loss of the
previous WINDOW steps, or its grad norm (before clipping) above GRAD_RATIO x the median grad
norm of the previous WINDOW steps, once MIN_HISTORY steps are seen. A spike at the end of
warmup can decide a short run on its own, so every run's summary lists its spikes and the
report flags the runs that had any. The detector's state travels in each checkpoint, so a
resumed run flags exactly what an uninterrupted one does.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from nlq.train.setup import Run

WINDOW = 50
MIN_HISTORY = 10
LOSS_RATIO = 1.5
GRAD_RATIO = 10.0


class Spikes:
    def __init__(self, state: dict | None = None):
        state = state or {}
        self.losses = deque(state.get("losses", []), maxlen=WINDOW)
        self.grads = deque(state.get("grads", []), maxlen=WINDOW)
        self.found: list[dict] = list(state.get("found", []))

    def update(self, step: int, loss: float, grad_norm: float) -> list[dict]:
        """Check step `step` (1-based, as metrics count steps) against the history, then add
        it to the history; returns the spikes it is (none, one or two kinds)."""
        new = []
        if len(self.losses) >= MIN_HISTORY:
            for kind, value, hist, ratio in (("loss", loss, self.losses, LOSS_RATIO),
                                             ("grad", grad_norm, self.grads, GRAD_RATIO)):
                ref = float(np.median(hist))
                if value > ratio * ref:
                    new.append({"step": step, "kind": kind, "value": value, "ref": ref})
        self.losses.append(loss)
        self.grads.append(grad_norm)
        self.found += new
        return new

    def state(self) -> dict:
        return {"losses": list(self.losses), "grads": list(self.grads), "found": self.found}


def flag_spikes(run: Run, step: int, loss: float, grad_norm: float, where: str = "") -> None:
    """Step `step`'s loss and grad norm through the run's spike detector: each spike a metrics
    row and a warning (where: what names the run in it, e.g. a stack member's path)."""
    for spike in run.spikes.update(step, loss, grad_norm):
        if run.world.main:
            run.files.log({"kind": "spike", "step": spike["step"], "of": spike["kind"],
                           "value": spike["value"], "ref": spike["ref"]})
            print(f"nlq: warning: {where}{spike['kind']} spike at step {spike['step']}: "
                  f"{spike['value']:.4g} vs running median {spike['ref']:.4g}", file=sys.stderr)
