"""How `nlq sweep` chooses and what it compares, computed two ways: the fitted vertex against a
known minimum or a closed-form 3-point vertex, the sweep's seeds against reproduce's, and the
matched-lr paired differences against a direct computation from the runs' summaries."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats

from nlq.errors import NlqError
from nlq.experiments.experiment import load_experiment
from nlq.experiments.reproduce import plan
from nlq.experiments.sweep import check_grid, choose, fit_lr, print_sweep, sweep_plan

SQRT2 = math.sqrt(2.0)


def three_point_vertex(lrs: list[float], f: list[float]) -> float | None:
    """The vertex lr of the parabola in ln(lr) through 3 equally spaced points, by hand:
    x_mid - h (f_hi - f_lo) / (2 (f_lo - 2 f_mid + f_hi)); None when it is not convex."""
    h = math.log(lrs[1] / lrs[0])
    curv = f[0] - 2 * f[1] + f[2]
    if curv <= 0:
        return None
    return math.exp(math.log(lrs[1]) - h * (f[2] - f[0]) / (2 * curv))


@pytest.mark.parametrize("step, n, best", [
    (2.0, 5, 0.013),      # off the grid, between 1.2e-2 and 2.4e-2
    (2.0, 5, 0.024),      # on a grid point
    (SQRT2, 7, 0.0171),   # 5 points fitted
    (SQRT2, 7, 0.0099),   # near the low edge: the window moves inward
])
def test_fit_finds_the_minimum_of_a_parabola_in_log_lr(step, n, best):
    lrs = [6e-3 * step ** i for i in range(n)]
    means = [3.2 + 0.05 * (math.log(lr / best)) ** 2 for lr in lrs]
    fit = fit_lr(lrs, means)
    assert fit["used"] and fit["vertex_lr"] == pytest.approx(best, rel=1e-9)
    assert fit["vertex_loss"] == pytest.approx(3.2, abs=1e-12)
    assert fit["lr"] == float(f"{best:.3g}")
    i = min(range(n), key=lambda j: means[j])
    assert fit["grid_best"] == lrs[i]
    # the points within x2 of the lowest, at least 3
    near = [lr for lr in lrs if abs(math.log(lr / lrs[i])) <= math.log(2) + 1e-9]
    assert fit["lrs"] == (near if len(near) >= 3 else fit["lrs"]) and len(fit["lrs"]) >= 3


def test_fit_on_three_points_is_the_closed_form_vertex():
    lrs = [6e-3, 1.2e-2, 2.4e-2, 4.8e-2, 9.6e-2]
    means = [3.5698, 3.4925, 3.4552, 3.6422, 3.5561]  # docs/experiments.md, nonlinear
    fit = fit_lr(lrs, means)
    assert fit["lrs"] == lrs[1:4]
    assert fit["vertex_lr"] == pytest.approx(three_point_vertex(lrs[1:4], means[1:4]), rel=1e-9)
    assert fit["used"] and fit["lr"] != fit["grid_best"]  # not snapped to the grid


@pytest.mark.parametrize("step, means, why", [
    (2.0, [3.2, 3.5, 3.6, 3.7, 3.8], "concave at the low edge"),
    (SQRT2, [3.6, 3.20, 3.5, 3.19, 3.5, 3.20, 3.6], "concave over 5 jagged points"),
    (2.0, [3.9, 3.8, 3.7, 3.6, 3.5], "a straight line: no vertex inside"),
    (2.0, [3.9, 3.6, 3.4, 3.3, 3.25], "convex, but its vertex beyond the top edge"),
])
def test_without_a_convex_vertex_inside_the_lowest_grid_point_is_chosen(step, means, why):
    lrs = [1e-3 * step ** i for i in range(len(means))]
    fit = fit_lr(lrs, means)
    i = min(range(len(means)), key=lambda j: means[j])
    assert not fit["used"], why
    assert fit["lr"] == fit["grid_best"] == lrs[i]


def test_the_rounded_lr_stays_within_the_fitted_points():
    """A vertex just inside the grid's low edge (1.4145e-3 on a grid from 1.414e-3) rounds to
    1.41e-3, outside every lr tried: the choice is kept at the edge."""
    lrs = check_grid([1.414e-3, 2e-3, 2.828e-3, 4e-3, 5.657e-3])
    x_v = math.log(1.4145e-3)
    fit = fit_lr(lrs, [3 + 0.5 * (math.log(v) - x_v) ** 2 for v in lrs])
    assert fit["used"] and fit["vertex_lr"] == pytest.approx(1.4145e-3)
    assert fit["lr"] == lrs[0]


def test_grids_of_sqrt2_steps_are_accepted_and_mixed_steps_refused():
    typed = [1e-2, 1.414e-2, 2e-2, 2.828e-2]  # 4 digits as a person types them
    assert check_grid(typed) == typed
    with pytest.raises(NlqError, match="one constant step.*0.002828 after 0.002 is x1.414"):
        check_grid([1e-3, 2e-3, 2.828e-3])
    with pytest.raises(NlqError, match="x1.5"):
        check_grid([1e-3, 1.5e-3, 2.25e-3])


def test_sweep_seeds_are_none_of_reproduces_seeds(tmp_path):
    grid = [6e-3, 1.2e-2, 2.4e-2]
    with pytest.raises(NlqError, match="'linear\\+12.5%' and 'linear\\+12.5%-lr' are the "
                       "same config once a sweep sets the lr"):
        sweep_plan("paper", "small", None, grid, 4, tmp_path / "sw", None)  # every paper arm
    arms = ["linear", "nonlinear", "nonlinear-official", "linear+12.5%", "identity", "residual"]
    specs, meta = sweep_plan("paper", "small", arms, grid, 4, tmp_path / "sw", None)
    seen = {(s.cfg.train.seed, s.cfg.data.seed) for s in specs}
    evaluated = {(s.cfg.train.seed, s.cfg.data.seed)
                 for s in plan(load_experiment("paper"), "small", 8, None, tmp_path / "rep")}
    assert len(seen) == 4 and not seen & evaluated
    assert meta["seed_indices"] == sorted({s.seed_index for s in specs})
    # seed index k means train.seed + k and data.seed + k, in every arm (reproduce's rule)
    k0 = plan(load_experiment("paper"), "small", 2, None, tmp_path / "rep")[0].cfg
    for s in specs:
        assert (s.cfg.train.seed, s.cfg.data.seed) == (k0.train.seed + s.seed_index,
                                                       k0.data.seed + s.seed_index)
        assert s.run_dir.name == f"seed{s.seed_index}"


def test_matched_lr_differences_equal_a_direct_computation(tmp_path, capsys):
    grid = [6e-3, 1.2e-2, 2.4e-2, 4.8e-2]
    specs, meta = sweep_plan("paper", "small", ["linear", "nonlinear"], grid, 4,
                             tmp_path / "sw", None)
    loss = {}
    for j, s in enumerate(specs):  # a bowl in lr, seed and arm effects, and some noise
        x = math.log(s.cfg.train.lr / 1.5e-2)
        loss[s.run_dir] = (3.4 + 0.04 * x * x + 0.01 * (s.seed_index - 1000)
                           - (0.02 if s.arm == "nonlinear" else 0.0) + 0.003 * math.sin(7 * j))
        s.run_dir.mkdir(parents=True)
        (s.run_dir / "summary.json").write_text(json.dumps(
            {"status": "finished", "step": 10, "val_loss": loss[s.run_dir]}))
    result = choose(specs, meta)

    def runs(arm, lr):  # {seed index: val loss} read back from the summaries
        return {s.seed_index: json.loads((s.run_dir / "summary.json").read_text())["val_loss"]
                for s in specs if s.arm == arm and s.cfg.train.lr == lr}

    t = stats.t.ppf(0.975, 3)
    for lr in grid:
        a, b = runs("nonlinear", lr), runs("linear", lr)
        d = [100 * (a[k] - b[k]) / b[k] for k in sorted(a)]
        mean = sum(d) / 4
        half = t * math.sqrt(sum((v - mean) ** 2 for v in d) / 3) / 2
        m = result["matched"]["nonlinear"][repr(lr)]
        assert m["n"] == 4
        assert m["mean_pct"] == pytest.approx(mean, rel=1e-12)
        assert (m["lo"], m["hi"]) == pytest.approx((mean - half, mean + half), rel=1e-9)
        assert result["results"]["linear"][repr(lr)] == [b[k] for k in sorted(b)]
    assert "linear" not in result["matched"]
    means = [sum(runs("linear", lr).values()) / 4 for lr in grid]
    assert result["chosen"]["linear"]["lr"] == fit_lr(grid, means)["lr"]
    assert result["chosen"]["linear"]["by"] == "fit"

    print_sweep(result, tmp_path / "sw")
    out = capsys.readouterr().out
    at = min(grid, key=lambda lr: abs(math.log(lr / result["chosen"]["linear"]["lr"])))
    m = result["matched"]["nonlinear"][repr(at)]
    assert (f"at lr {at:.3g} for both (nearest linear's choice): nonlinear vs linear "
            f"{m['mean_pct']:+.2f}% [{m['lo']:+.2f}, {m['hi']:+.2f}]") in out
