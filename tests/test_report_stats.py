"""nlq.report.stats: the t quantile against tables and closed forms, intervals against hand sums."""

import math

import pytest

from nlq.report.stats import (
    detectable,
    high_outliers,
    mean_ci,
    paired,
    paired_power,
    ppl_change_pct,
    rel_change_pct,
    seeds_for_power,
    t_quantile,
)

# t_{0.975, df} from a printed table (4 decimals).
TABLE = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 9: 2.2622, 29: 2.0452}


@pytest.mark.parametrize("df,want", sorted(TABLE.items()))
def test_t_quantile_matches_table(df, want):
    assert t_quantile(0.975, df) == pytest.approx(want, abs=5e-5)
    assert t_quantile(0.025, df) == pytest.approx(-want, abs=5e-5)


@pytest.mark.parametrize("p", [0.5, 0.6, 0.9, 0.975, 0.995, 0.9999, 0.01, 1e-6])
def test_t_quantile_matches_closed_forms(p):
    # df = 1 is Cauchy: tan(pi (p - 1/2)); df = 2: (2p - 1) / sqrt(2 p (1 - p)).
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9, abs=1e-12)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)),
                                             rel=1e-9, abs=1e-12)


def test_t_quantile_tends_to_normal_and_rejects_bad_input():
    assert t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)
    assert t_quantile(0.5, 3) == 0.0
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_mean_ci_by_hand():
    # values 1, 2, 4: mean 7/3, sd sqrt(((4/3)^2 + (1/3)^2 + (5/3)^2) / 2) = sqrt(7/3)
    e = mean_ci([1.0, 2.0, 4.0])
    half = 4.302652729749464 * math.sqrt(7 / 3) / math.sqrt(3)
    assert (e.n, e.mean, e.sd) == (3, pytest.approx(7 / 3), pytest.approx(math.sqrt(7 / 3)))
    assert (e.lo, e.hi) == (pytest.approx(7 / 3 - half), pytest.approx(7 / 3 + half))


def test_one_value_has_no_interval():
    e = mean_ci([3.5])
    assert (e.mean, e.lo, e.hi, e.sd, e.n) == (3.5, None, None, None, 1)
    assert not e.has_interval and not e.excludes_zero
    with pytest.raises(ValueError):
        mean_ci([])


def test_paired_interval_by_hand():
    # Three seeds. Baseline 4.0, 4.1, 4.2; arm 3.96, 4.018, 4.137: relative changes exactly
    # -1.0, -2.0, -1.5 %. Mean -1.5, sd sqrt((0.25 + 0.25 + 0) / 2) = 0.5,
    # half width t_{0.975,2} * 0.5 / sqrt(3) = 4.302653 * 0.288675 = 1.242069.
    base = {0: 4.0, 1: 4.1, 2: 4.2, 7: 4.3}  # seed 7 has no partner
    arm = {0: 3.96, 1: 4.018, 2: 4.137}
    p = paired(arm, base)
    assert p.seeds == [0, 1, 2] and p.only_base == [7] and p.only_arm == []
    assert p.log_loss_pct == pytest.approx([-1.0, -2.0, -1.5])
    e = p.log_loss()
    assert e.mean == pytest.approx(-1.5)
    assert e.sd == pytest.approx(0.5)
    assert e.lo == pytest.approx(-2.742069, abs=1e-6)
    assert e.hi == pytest.approx(-0.257931, abs=1e-6)
    assert e.excludes_zero
    # Perplexity: 100 (e^-0.04 - 1), 100 (e^-0.082 - 1), 100 (e^-0.063 - 1)
    assert p.ppl_pct == pytest.approx([-3.921056, -7.872804, -6.105653], abs=1e-6)
    # The perplexity interval is 100 expm1 of the log-loss difference's interval: differences
    # -0.04, -0.082, -0.063 nats, mean -0.185/3, sd 0.0210317, half width 0.0522457.
    assert p.diff == pytest.approx([-0.04, -0.082, -0.063])
    q = p.ppl()
    assert q.mean == pytest.approx(100 * math.expm1(-0.185 / 3), abs=1e-9)
    assert q.mean == pytest.approx(-5.980377, abs=1e-6)
    assert (q.lo, q.hi) == (pytest.approx(-10.766384, abs=1e-6), pytest.approx(-0.937673, abs=1e-6))


def test_relative_changes():
    assert rel_change_pct(2.919, 2.956) == pytest.approx(-1.2517, abs=1e-4)
    assert ppl_change_pct(2.0, 2.0) == 0.0
    assert ppl_change_pct(3.0, 2.0) == pytest.approx(100 * (math.e - 1))


def test_paired_power_matches_a_simulated_t_test():
    """The noncentral-t power equals the share of simulated paired t-tests that reject, and
    seeds_for_power / detectable invert it (80% reached there, not one seed or 1% sooner)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for effect, sd, n in ((1.0, 1.0, 10), (0.5, 1.2, 8), (0.9, 1.13, 15)):
        x = rng.normal(effect, sd, size=(100_000, n))
        t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))
        sim = float((np.abs(t) > t_quantile(0.975, n - 1)).mean())
        assert paired_power(effect, sd, n) == pytest.approx(sim, abs=0.006)
    assert seeds_for_power(1.0, 1.0) == 10  # (t_.975 + t_.8) sd / sqrt(n) <= 1 from n = 10
    for effect, sd in ((1.0, 1.0), (-0.893, 1.125), (0.2, 1.5)):
        n = seeds_for_power(effect, sd)
        assert paired_power(effect, sd, n) >= 0.8 > paired_power(effect, sd, n - 1)
        mde = detectable(sd, n)
        assert paired_power(mde, sd, n) == pytest.approx(0.8, abs=1e-6) and mde <= abs(effect)
    assert seeds_for_power(0.0, 1.0) is None and seeds_for_power(1.0, 0.0) is None
    assert detectable(1.0, 1) is None and detectable(0.0, 5) is None
    assert paired_power(40.0, 1.0, 10) == 1.0  # a far tail that underflows counts as 0


def test_high_outliers_flag_only_runs_far_above_their_arm():
    """Robust z = (x - median) / (1.4826 MAD): a run 0.3 nats above seeds spread by ~0.01 is
    flagged, a low run or a merely worst-of-the-rest run is not; too few runs or no spread:
    nothing (the flagged ones cannot hide themselves by inflating an sd)."""
    arm = {s: 3.80 + 0.01 * ((s * 7) % 5 - 2) for s in range(8)}  # 3.78 .. 3.82
    assert high_outliers(arm) == {}
    far = high_outliers(arm | {8: 4.10, 9: 3.50, 10: 3.83})
    med = 3.80
    mad = sorted(abs(v - med) for v in (arm | {8: 4.10, 9: 3.50, 10: 3.83}).values())[5]
    assert list(far) == [8] and far[8] == pytest.approx((4.10 - med) / (1.4826 * mad))
    assert high_outliers({0: 1.0, 1: 9.0, 2: 1.0}) == {}  # fewer than 4 runs
    assert high_outliers({s: 2.0 for s in range(6)} | {6: 3.0}) == {}  # MAD 0
