"""A two-level bootstrap of a paired comparison: over seeds, then over units of the test split
within each seed.

The paired t-interval (nlq/report/stats.py) sees only seed-to-seed variation; the test split is
a finite sample of text too. Each replicate draws n seeds with replacement and, within each
drawn seed, the test units with replacement (the same units for both arms of the pair),
recomputes each arm's log-loss as sum(nats) / sum(tokens) over the drawn units, and averages
the per-seed relative differences. The 95% interval is the 2.5 and 97.5 percentiles of the
replicates.

The units are chunks of block_size scored tokens of the test stream where the runs recorded
them (nlq/run/scoring.py), else documents: one document holds 44% of the `small` preset's
test tokens, so a bootstrap over documents mostly measures whether that one was drawn.

Legend: R replicates, n seeds, D units.
"""

from __future__ import annotations

import numpy as np

REPS = 2000
SEED = 20260303  # fixed: the same runs give the same interval
BATCH = 100  # replicates weighed at a time: (BATCH, n, D) floats, not (R, n, D)


def paired_bootstrap(arm_nats: np.ndarray, base_nats: np.ndarray, tokens: np.ndarray,
                     level: float = 0.95, reps: int = REPS, seed: int = SEED) -> dict:
    """arm_nats, base_nats: (n, D) per-seed, per-unit nats; tokens: (n, D) (the same units,
    so the same counts in both arms). Returns the mean relative difference in % of the
    baseline's log-loss and its percentile interval {"mean", "lo", "hi", "reps"}."""
    a, b, t = (np.asarray(x, dtype=np.float64) for x in (arm_nats, base_nats, tokens))
    n, D = a.shape
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, n, size=(reps, n))  # (R, n) seeds drawn
    stat = np.empty(reps)  # (R,)
    for s in range(0, reps, BATCH):
        p = pick[s:s + BATCH]  # (r, n)
        # the rows of one (R, n) multinomial draw, in order: batching keeps the stream
        w = rng.multinomial(D, np.full(D, 1.0 / D), size=p.shape).astype(np.float64)  # (r, n, D)
        tok = np.einsum("rnd,rnd->rn", w, t[p])  # (r, n)
        la = np.einsum("rnd,rnd->rn", w, a[p]) / tok  # (r, n)
        lb = np.einsum("rnd,rnd->rn", w, b[p]) / tok  # (r, n)
        stat[s:s + BATCH] = (100.0 * (la - lb) / lb).mean(axis=1)
    full = (100.0 * (a.sum(1) / t.sum(1) - b.sum(1) / t.sum(1)) / (b.sum(1) / t.sum(1))).mean()
    q = (1.0 - level) / 2.0
    lo, hi = np.quantile(stat, [q, 1.0 - q])
    return {"mean": float(full), "lo": float(lo), "hi": float(hi), "reps": reps}
