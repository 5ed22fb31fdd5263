"""Statistics over seeds: mean with a 95% t-interval, and paired comparisons against a baseline.

The paper ran one seed per arm (PAPER.md); here every arm may have several seeds, and two
arms are compared seed by seed (same init seed, same batch schedule), so the interval is the
paired one: a t-interval over the per-seed differences. With one value there is no interval:
`lo`/`hi` are None, never a made-up width.

The Student-t quantile is computed here (no scipy): the t CDF through the regularized
incomplete beta function (a continued fraction, Numerical Recipes 6.4), inverted by
bisection. Legend: p probability, df degrees of freedom, x = df / (df + t^2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

LEVEL = 0.95


# ---------------------------------------------------------------------------------------
# Student-t distribution


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of I_x(a, b) (modified Lentz), converging fast for x < (a+1)/(a+b+2)."""
    tiny, eps = 1e-300, 1e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                    -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc: x must be in [0, 1], got {x}")
    if x == 0.0 or x == 1.0:
        return x
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df > 0 degrees of freedom."""
    if df <= 0:
        raise ValueError(f"t_cdf: df must be positive, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (e.g. t_quantile(0.975, 2) = 4.3027).

    Solves I_x(df/2, 1/2) = 2 * min(p, 1-p) for x by bisection (I_x increases with x), then
    t = sqrt(df (1 - x) / x); bisection to relative precision 1e-15 in x keeps t exact to
    ~1e-12 even in the far tail of df = 1."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"t_quantile: df must be positive, got {df}")
    if p == 0.5:
        return 0.0
    target = 2.0 * min(p, 1.0 - p)
    a = df / 2.0
    lo, hi = 0.0, 1.0
    for _ in range(2000):
        mid = 0.5 * (lo + hi)
        if betainc(a, 0.5, mid) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    x = 0.5 * (lo + hi)
    t = math.sqrt(df * (1.0 - x) / x)
    return t if p > 0.5 else -t


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

    @property
    def n(self) -> int:
        return len(self.seeds)

    def log_loss(self, level: float = LEVEL) -> Estimate | None:
        return mean_ci(self.log_loss_pct, level) if self.seeds else None

    def ppl(self, level: float = LEVEL) -> Estimate | None:
        return mean_ci(self.ppl_pct, level) if self.seeds else None

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
    )


def _seed_key(s) -> tuple:
    return (0, s, "") if isinstance(s, (int, float)) else (1, 0, str(s))
