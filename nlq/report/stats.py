"""Statistics over seeds: mean with a 95% t-interval, and paired comparisons against a baseline.

The paper ran one seed per arm (docs/paper.md, "The paper's numbers"); here every arm may
have several seeds, and two arms are compared seed by seed (same init seed, same batch
schedule), so the interval is the paired one: a t-interval over the per-seed differences.
With one value there is no interval: `lo`/`hi` are None, never a made-up width.

Legend: p probability, df degrees of freedom.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from nlq.extras import need

LEVEL = 0.95


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p for Student's t with df degrees of freedom (scipy)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"t_quantile: df must be positive, got {df}")
    return float(need("scipy.stats", "a t-interval").t.ppf(p, df))


# ---------------------------------------------------------------------------------------
# runs far from their arm

OUTLIER_Z = 5.0


def high_outliers(values: Mapping, z: float = OUTLIER_Z) -> dict:
    """{key: robust z} of the values more than z robust sds above their median, the robust sd
    being 1.4826 x the median absolute deviation (the sd for normal data, untouched by the
    outliers themselves). Only high ones: a run whose loss ended far above its arm's others
    (e.g. one that left the first plateau late). Fewer than 4 values, or a MAD of 0: none."""
    import statistics

    if len(values) < 4:
        return {}
    med = statistics.median(values.values())
    sd = 1.4826 * statistics.median(abs(v - med) for v in values.values())
    if not sd > 0:
        return {}
    return {k: (v - med) / sd for k, v in values.items() if (v - med) / sd > z}


# ---------------------------------------------------------------------------------------
# power of a paired comparison (for planning a design, never for judging one)

POWER = 0.8


def paired_power(effect: float, sd: float, n: int, level: float = LEVEL) -> float:
    """The probability that the two-sided paired t-test at 1 - level finds a difference with
    n seeds when the true mean difference is effect and the per-seed sd of the differences is
    sd: the noncentral t with n - 1 degrees of freedom (scipy)."""
    st = need("scipy.stats", "a power figure")
    df, nc = n - 1, abs(effect) / sd * math.sqrt(n)
    crit = st.t.ppf(1 - (1 - level) / 2, df)
    wrong_side = float(st.nct.cdf(-crit, df, nc))  # NaN where it underflows (large nc): ~0
    return float(st.nct.sf(crit, df, nc)) + (0.0 if math.isnan(wrong_side) else wrong_side)


def seeds_for_power(effect: float, sd: float, power: float = POWER, level: float = LEVEL,
                    most: int = 10_000) -> int | None:
    """The fewest seeds (>= 2) at which paired_power reaches power; None when effect is 0,
    sd is not positive, or more than `most` seeds would be needed."""
    if not sd > 0 or effect == 0 or paired_power(effect, sd, most, level) < power:
        return None
    lo, hi = 2, most  # power rises with n: bisect for the first n that reaches it
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if paired_power(effect, sd, mid, level) >= power else (mid + 1, hi)
    return lo


def detectable(sd: float, n: int, power: float = POWER, level: float = LEVEL) -> float | None:
    """The smallest true mean difference that n seeds find with the given power (the
    minimum detectable effect, in sd's unit); None for n < 2 or sd not positive."""
    if n < 2 or not sd > 0:
        return None
    brentq = need("scipy.optimize", "a power figure").brentq
    return float(brentq(lambda e: paired_power(e, sd, n, level) - power, 1e-9 * sd, 1e3 * sd,
                        xtol=1e-9 * sd))


# ---------------------------------------------------------------------------------------
# estimates over seeds


@dataclass(frozen=True)
class Estimate:
    """A mean over n values with its t-interval; lo/hi/sd are None when n < 2."""

    mean: float
    lo: float | None
    hi: float | None
    n: int
    sd: float | None
    level: float = LEVEL

    @property
    def has_interval(self) -> bool:
        return self.lo is not None and self.hi is not None

    @property
    def excludes_zero(self) -> bool:
        """True when the interval lies wholly above or below 0 (False without an interval)."""
        return self.has_interval and (self.lo > 0 or self.hi < 0)

    def to_dict(self) -> dict:
        return asdict(self)


def mean_ci(values: Sequence[float], level: float = LEVEL) -> Estimate:
    """Mean and two-sided t-interval: mean +- t_{(1+level)/2, n-1} * sd / sqrt(n)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        raise ValueError("mean_ci: no values")
    mean = math.fsum(xs) / n
    if n == 1:
        return Estimate(mean, None, None, 1, None, level)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half, n, sd, level)


def rel_change_pct(arm: float, base: float) -> float:
    """Relative change of a log-loss in %: 100 (L_arm - L_base) / L_base (negative = better)."""
    return 100.0 * (arm - base) / base


def ppl_change_pct(arm_loss: float, base_loss: float) -> float:
    """Relative change of perplexity in %: 100 (e^L_arm - e^L_base) / e^L_base (negative =
    better), computed as 100 expm1(L_arm - L_base) to stay exact for tiny differences."""
    return 100.0 * math.expm1(arm_loss - base_loss)


@dataclass(frozen=True)
class Paired:
    """Per-seed relative changes of an arm vs a baseline, matched by seed."""

    seeds: list
    log_loss_pct: list[float]
    ppl_pct: list[float]
    only_arm: list
    """Seeds the arm has and the baseline lacks (not in the comparison)."""
    only_base: list
    diff: list[float] = ()
    """Per-seed L_arm - L_base in nats: the perplexity ratio is exp of it."""

    @property
    def n(self) -> int:
        return len(self.seeds)

    def log_loss(self, level: float = LEVEL) -> Estimate | None:
        return mean_ci(self.log_loss_pct, level) if self.seeds else None

    def ppl(self, level: float = LEVEL) -> Estimate | None:
        """Perplexity change in %, from the interval of the log-loss difference: 100 expm1
        of its mean and of its ends, so never below -100%."""
        if not self.seeds:
            return None
        e = mean_ci(self.diff, level)
        f = (lambda x: None if x is None else 100.0 * math.expm1(x))
        return Estimate(f(e.mean), f(e.lo), f(e.hi), e.n, None, level)

    def to_dict(self, level: float = LEVEL) -> dict:
        ll, pp = self.log_loss(level), self.ppl(level)
        return {
            "n_pairs": self.n,
            "log_loss_pct": ll.to_dict() if ll else None,
            "ppl_pct": pp.to_dict() if pp else None,
            "per_seed": [{"seed": s, "log_loss_pct": a, "ppl_pct": b}
                         for s, a, b in zip(self.seeds, self.log_loss_pct, self.ppl_pct)],
            "seeds_only_in_arm": self.only_arm,
            "seeds_only_in_baseline": self.only_base,
        }


def paired(arm: Mapping, base: Mapping) -> Paired:
    """arm, base: {seed: final log-loss}. Seeds present in both are paired, in sorted order."""
    common = sorted(set(arm) & set(base), key=_seed_key)
    return Paired(
        seeds=common,
        log_loss_pct=[rel_change_pct(arm[s], base[s]) for s in common],
        ppl_pct=[ppl_change_pct(arm[s], base[s]) for s in common],
        only_arm=sorted(set(arm) - set(base), key=_seed_key),
        only_base=sorted(set(base) - set(arm), key=_seed_key),
        diff=[arm[s] - base[s] for s in common],
    )


def _seed_key(s) -> tuple:
    return (0, s, "") if isinstance(s, (int, float)) else (1, 0, str(s))
