"""A two-level bootstrap of a paired comparison: over seeds, then over test documents.

The paired t-interval (nlq/eval/stats.py) sees only seed-to-seed variation; the test split is
a finite sample of documents too. Each replicate draws n seeds with replacement and, within
each drawn seed, the test documents with replacement (the same documents for both arms of
the pair), recomputes each arm's log-loss as sum(nats) / sum(tokens) over the drawn
documents, and averages the per-seed relative differences. The 95% interval is the 2.5 and
97.5 percentiles of the replicates.

Legend: R replicates, n seeds, D documents.
"""

from __future__ import annotations

import numpy as np

REPS = 2000
SEED = 20260303  # fixed: the same runs give the same interval


def paired_bootstrap(arm_nats: np.ndarray, base_nats: np.ndarray, tokens: np.ndarray,
                     level: float = 0.95, reps: int = REPS, seed: int = SEED) -> dict:
    """arm_nats, base_nats: (n, D) per-seed, per-document nats; tokens: (n, D) (the same
    documents, so the same counts in both arms). Returns the mean relative difference in % of
    the baseline's log-loss and its percentile interval {"mean", "lo", "hi", "reps"}."""
    a, b, t = (np.asarray(x, dtype=np.float64) for x in (arm_nats, base_nats, tokens))
    n, D = a.shape
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, n, size=(reps, n))  # (R, n) seeds drawn
    w = rng.multinomial(D, np.full(D, 1.0 / D), size=(reps, n)).astype(np.float64)  # (R, n, D)
    la = np.einsum("rnd,rnd->rn", w, a[pick]) / np.einsum("rnd,rnd->rn", w, t[pick])  # (R, n)
    lb = np.einsum("rnd,rnd->rn", w, b[pick]) / np.einsum("rnd,rnd->rn", w, t[pick])  # (R, n)
    stat = (100.0 * (la - lb) / lb).mean(axis=1)  # (R,)
    full = (100.0 * (a.sum(1) / t.sum(1) - b.sum(1) / t.sum(1)) / (b.sum(1) / t.sum(1))).mean()
    q = (1.0 - level) / 2.0
    lo, hi = np.quantile(stat, [q, 1.0 - q])
    return {"mean": float(full), "lo": float(lo), "hi": float(hi), "reps": reps}
