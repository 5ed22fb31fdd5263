"""A bootstrap of a paired comparison over seeds and over the units of the test split.

The paired t-interval (nlq/report/stats.py) sees only seed-to-seed variation; the test split is
a finite sample of text too. Seeds and test units are crossed, not nested: every run is scored
on the same test split, so its sampling error is shared by all seeds and does not average out
over them. Each replicate therefore draws n seeds with replacement and, independently, one
set of test units with replacement, used for every drawn seed and both arms of the pair (the
pigeonhole bootstrap of a crossed design, Owen 2007, Ann. Appl. Stat. 1(2); it errs on the
wide side), recomputes each arm's log-loss as sum(nats) / sum(tokens) over the drawn units,
and averages the per-seed relative differences. The 95% interval is the 2.5 and 97.5
percentiles of the replicates. (Drawing the units seed by seed, as if each seed had a test
split of its own, shrank the test split's part of the interval by sqrt(n).)

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
        # one draw of the units per replicate, shared by its seeds: every run is scored on
        # the same test split, so its sampling error is common to all seeds and does not
        # average out over them (rows of one (R, D) multinomial draw, in order)
        w = rng.multinomial(D, np.full(D, 1.0 / D), size=len(p)).astype(np.float64)  # (r, D)
        tok = np.einsum("rd,rnd->rn", w, t[p])  # (r, n)
        la = np.einsum("rd,rnd->rn", w, a[p]) / tok  # (r, n)
        lb = np.einsum("rd,rnd->rn", w, b[p]) / tok  # (r, n)
        stat[s:s + BATCH] = (100.0 * (la - lb) / lb).mean(axis=1)
    full = (100.0 * (a.sum(1) / t.sum(1) - b.sum(1) / t.sum(1)) / (b.sum(1) / t.sum(1))).mean()
    q = (1.0 - level) / 2.0
    lo, hi = np.quantile(stat, [q, 1.0 - q])
    return {"mean": float(full), "lo": float(lo), "hi": float(hi), "reps": reps}
