"""The Holm family is every comparison the report gives a verdict on: the experiment's
pre-registered comparisons; everything else is described. And convergence: each arm's
val-loss slope over the last 10% of its steps, recomputed by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_report import make_run
from test_report_noise import experiment

from nlq.report.claims import Claims
from nlq.report.convergence import run_slope
from nlq.report.report import build_report, summary_lines
from nlq.report.runs import collect
from nlq.report.stats import mean_ci


def test_only_the_family_gets_verdicts_and_holm_counts_only_it(tmp_path):
    """Family: nonlinear vs linear alone. linear+12.5% is clearly better than linear, and
    nonlinear than linear+12.5%, but neither pair is in the family: described, and Holm's m is
    1 (its interval is the plain 95% one)."""
    exp = experiment(tmp_path / "exp")
    family = Claims(ordering=("nonlinear", "linear+12.5%", "linear"),
                    comparisons=(("nonlinear", "linear"),))
    rep = build_report([exp], tmp_path / "out", claims=family)
    [c] = rep["preregistered"]
    assert c["holm_level"] == 0.95 and c["ci_holm"] == pytest.approx(c["ci95"])
    assert rep["preregistered_verdicts"][0].startswith("nonlinear beats linear")
    assert rep["ordering"]["status"] == "described"
    wide = next(r for r in rep["arms"] if r["arm"] == "linear+12.5%")
    assert not wide["preregistered"] and "not a pre-registered comparison" in wide["descriptive"]
    md = (tmp_path / "out" / "report.md").read_text()
    text = md + "\n".join(summary_lines(rep))
    # the one verdict, and no other "beats" / "worse" / "holds" anywhere
    assert text.count(" beats ") == 2  # report.md and the printed summary
    assert "is worse than" not in text and "holds here" not in text
    # with the family the paper declares, the ordering is judged from the family and control
    paper = Claims(ordering=family.ordering, comparisons=(("nonlinear", "linear"),
                                                          ("nonlinear", "linear+12.5%")),
                   positive_control=("linear+12.5%", "linear"))
    judged = build_report([exp], tmp_path / "paper", claims=paper)
    assert judged["ordering"]["status"] == "holds"
    assert [c["holm_level"] for c in judged["preregistered"]] == pytest.approx([0.975, 0.95])


def test_a_failed_control_gives_no_verdict_anywhere(tmp_path):
    """No verdict anywhere when the control fails: every arm is described."""
    exp = experiment(tmp_path / "exp", gain_wide=0.0)
    rep = build_report([exp], tmp_path / "out", claims=Claims(
        comparisons=(("nonlinear", "linear"),), positive_control=("linear+12.5%", "linear")))
    assert not rep["verdicts_allowed"] and rep["preregistered_verdicts"] == []
    assert all("descriptive" in r for r in rep["arms"] if r["arm"] != "linear")


def test_slopes_equal_a_hand_computation(tmp_path):
    """The last 10% of 30 steps holds only the eval at 30: the slope is through the last two
    evals (20 and 30), (L30 - L20) / 10 per step; averaged over seeds."""
    for seed, last in ((0, 4.5), (1, 4.7)):
        make_run(tmp_path, "linear", seed, [9.0, 6.0, 5.0, last])
    runs = collect([tmp_path / "runs"])
    slopes = [run_slope(r) for r in runs]
    for r, f in zip(runs, slopes):
        (s0, l0), (s1, l1) = r.evals[-2:]
        assert f["slope_per_1k"] == pytest.approx(1000 * (l1 - l0) / (s1 - s0))
        assert f["fall_pct"] == pytest.approx(100 * (l0 - l1) / l1)
    rep = build_report([tmp_path / "runs"], tmp_path / "out")
    [arm] = rep["convergence"]["arms"]
    assert arm["slope_per_1k"] == pytest.approx(np.mean([f["slope_per_1k"] for f in slopes]))
    # one arm: no interval to judge by, so no verdict on convergence either
    assert arm["converged"] is None and rep["convergence"]["half_width_pct"] is None


def test_a_least_squares_line_over_the_last_tenth(tmp_path):
    """Evals every 10 of 200 steps: the last 10% (steps 180, 190, 200) give a fitted line;
    np.polyfit over those three points by hand."""
    d = make_run(tmp_path, "linear", 0, [9.0])
    steps = list(range(0, 201, 10))
    vals = [3 + 2 * np.exp(-s / 60) + 0.001 * (s % 20 == 0) for s in steps]
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "eval", "step": s, "val_loss": v}) + "\n"
        for s, v in zip(steps, vals)))
    [r] = collect([d])
    f = run_slope(r)
    want = np.polyfit(steps[-3:], vals[-3:], 1)[0]
    assert f["slope_per_1k"] == pytest.approx(1000 * want) and f["from_step"] == 180


def test_still_falling_runs_are_not_converged(tmp_path):
    """Two arms whose val loss falls 10% over the last step span, with a paired interval a
    fraction of a percent wide: not converged; flat curves: converged."""
    for name, tail in (("falling", [6.0, 5.0, 4.5]), ("flat", [4.5, 4.5, 4.5])):
        root = tmp_path / name
        for seed, shift in ((0, 0.0), (1, 0.01), (2, -0.01)):
            make_run(root, "linear", seed, [9.0, *(x + shift for x in tail)])
            make_run(root, "nonlinear", seed, [9.0, *(x + shift - 0.05 + 0.002 * seed
                                                      for x in tail)],
                     {"model.query": "nonlinear"})
        conv = build_report([root / "runs"], tmp_path / f"out-{name}")["convergence"]
        e = mean_ci([100 * ((tail[-1] + sh - 0.05 + 0.002 * k) / (tail[-1] + sh) - 1)
                     for k, sh in ((0, 0.0), (1, 0.01), (2, -0.01))])
        assert conv["half_width_pct"] == pytest.approx((e.hi - e.lo) / 2)
        if name == "falling":
            assert conv["not_converged"] == ["linear", "nonlinear"]
            assert conv["answer"].startswith("The runs are not converged")
        else:
            assert conv["not_converged"] == [] and "converged" in conv["answer"]
