"""`nlq sweep` and `nlq reproduce --lrs-from`: a grid that tunes every arm alike, chosen on
val, and clear errors for a bad grid or a changed plan."""

from __future__ import annotations

import json

import pytest
from helpers import assert_user_error, nlq, ok
from test_reproduce import mini_setting
from test_sweep_fit import three_point_vertex

from nlq.errors import NlqError
from nlq.experiments.reproduce import read_sweep_lrs
from nlq.experiments.sweep import SEED_OFFSET, check_grid


@pytest.mark.parametrize("grid, match", [
    ([1e-3, 2e-3, -4e-3], "-0.004 is not a positive finite"),
    ([1e-3, 2e-3, float("nan")], "nan is not a positive finite"),
    ([0.0, 2e-3, 4e-3], "0.0 is not a positive finite"),
    ([1e-3, 2e-3], "at least 3 values"),
    ([1e-3, 2e-3, 5e-3], r"x2 or x sqrt\(2\): 0.005 after 0.002 is x2.5"),
    ([4e-3, 2e-3, 1e-3], "one constant step"),
])
def test_bad_grids_are_named(grid, match):
    with pytest.raises(NlqError, match=match):
        check_grid(grid)


def test_grid_of_x2_steps_is_accepted():
    assert check_grid([6e-3, 1.2e-2, 2.4e-2]) == [6e-3, 1.2e-2, 2.4e-2]


def sweep(tmp_path, out, lrs="2e-3,4e-3,8e-3", seeds="2"):
    exp, sets = mini_setting(tmp_path)
    return nlq("sweep", "--experiment", exp, "--preset", "tiny", "--arms", "linear",
               "--lrs", lrs, "--seeds", seeds, "--out", out, "--jobs", "2", *sets,
               timeout=600), sets


def test_sweep_chooses_on_val_and_reproduce_uses_it(tmp_path):
    out = tmp_path / "sw"
    p, sets = sweep(tmp_path, out)
    ok(p)
    said = p.stdout + p.stderr
    assert "sweep: linear " in said and "reproduce:" not in said  # its own name
    result = json.loads((out / "sweep.json").read_text())
    assert result["grid"] == [2e-3, 4e-3, 8e-3] and result["seeds"] == 2
    assert result["seed_indices"] == [SEED_OFFSET, SEED_OFFSET + 1]
    assert (out / "sweep.png").stat().st_size > 0
    by_lr = result["results"]["linear"]
    for lr, vals in by_lr.items():  # every value is a run's final val loss
        runs = sorted((out / "runs" / f"lr{float(lr):.4g}" / "linear").glob("seed*"))
        assert vals == [json.loads((r / "summary.json").read_text())["val_loss"] for r in runs]
        assert all("test_loss" not in json.loads((r / "summary.json").read_text())
                   for r in runs)  # the test split is not even computed while choosing
    assert sorted(p.name for p in (out / "runs" / "lr0.002" / "linear").iterdir()) == [
        f"seed{SEED_OFFSET}", f"seed{SEED_OFFSET + 1}"]  # never a seed of `nlq reproduce`
    # the choice on 3 points: the vertex of the parabola through them, or the lowest point
    lrs = sorted(float(lr) for lr in by_lr)
    means = [sum(by_lr[repr(lr)]) / 2 for lr in lrs]
    vertex = three_point_vertex(lrs, means)
    if vertex is not None and lrs[0] <= vertex <= lrs[-1]:
        assert result["chosen"]["linear"]["lr"] == pytest.approx(vertex, rel=5e-3)
    else:
        assert result["chosen"]["linear"]["lr"] == lrs[means.index(min(means))]
    assert "chosen" in p.stdout and "| linear |" in p.stdout

    # other seeds in the same folder: refused, nothing lost
    before = (out / "sweep.json").read_text()
    p2, _ = sweep(tmp_path, out, seeds="3")
    assert_user_error(p2, "another plan", "seeds")
    assert (out / "sweep.json").read_text() == before
    # a widened grid reuses every finished lr and trains only the new one
    done = {r: r.stat().st_mtime_ns for r in (out / "runs").rglob("summary.json")}
    p2, _ = sweep(tmp_path, out, lrs="2e-3,4e-3,8e-3,1.6e-2")
    ok(p2)
    assert all(r.stat().st_mtime_ns == t for r, t in done.items())
    wide = json.loads((out / "sweep.json").read_text())
    assert wide["grid"] == [2e-3, 4e-3, 8e-3, 1.6e-2] and len(wide["results"]["linear"]) == 4
    assert {k: wide["results"]["linear"][k] for k in by_lr} == by_lr
    result = wide

    # reproduce at the chosen lr, with its provenance
    exp = tmp_path / "mini.toml"
    rep = tmp_path / "rep"
    ok(nlq("reproduce", "--experiment", exp, "--preset", "tiny", "--arms", "linear",
           "--seeds", "2", "--out", rep, "--jobs", "2", "--lrs-from", out / "sweep.json",
           *sets, timeout=600))
    lr = result["chosen"]["linear"]["lr"]
    lrs = json.loads((rep / "lrs.json").read_text())
    assert lrs["lrs"] == {"linear": lr} and lrs["commit"] == result["commit"]
    cfg = (rep / "runs" / "linear" / "seed0" / "config.toml").read_text()
    assert f"lr = {lr!r}" in cfg
    assert "Learning rates: chosen per arm on val by `nlq sweep`" in (rep / "report.md").read_text()
    # the same folder without --lrs-from plans other lrs: refused
    p3 = nlq("reproduce", "--experiment", exp, "--preset", "tiny", "--arms", "linear",
             "--seeds", "2", "--out", rep, "--jobs", "2", *sets, timeout=600)
    assert_user_error(p3, "another config", "train.lr")


def test_lrs_from_checks_preset_sets_and_arms(tmp_path):
    f = tmp_path / "sweep.json"
    f.write_text(json.dumps({"preset": "small", "sets": {}, "commit": "abc",
                             "chosen": {"linear": {"lr": 0.01, "val_loss": 3.0}}}))
    assert read_sweep_lrs(f, "small", {}, ["linear"])["lrs"] == {"linear": 0.01}
    with pytest.raises(NlqError, match="preset 'small', this command on 'tiny'"):
        read_sweep_lrs(f, "tiny", {}, ["linear"])
    with pytest.raises(NlqError, match="arm 'nonlinear' was not swept"):
        read_sweep_lrs(f, "small", {}, ["linear", "nonlinear"])
    with pytest.raises(NlqError, match="another setting"):
        read_sweep_lrs(f, "small", {"train.max_steps": 5}, ["linear"])
    with pytest.raises(NlqError, match="cannot read"):
        read_sweep_lrs(tmp_path / "missing.json", "small", {}, ["linear"])


def test_an_lr_at_the_grid_edge_is_carried_into_the_report(tmp_path):
    """sweep.json's edge flags reach lrs.json and report.md: the arm may be under-tuned."""
    from pathlib import Path

    from nlq.report.markdown import render_markdown

    f = tmp_path / "sweep.json"
    f.write_text(json.dumps({"preset": "small", "sets": {}, "commit": "abc",
                             "chosen": {"linear": {"lr": 0.01}, "nonlinear": {"lr": 0.02}},
                             "edge": {"linear": False, "nonlinear": True}}))
    lrs = read_sweep_lrs(f, "small", {}, ["linear", "nonlinear"])
    assert lrs["edge"] == ["nonlinear"]
    f.write_text(f.read_text().replace("true", "false"))
    assert "edge" not in read_sweep_lrs(f, "small", {}, ["linear", "nonlinear"])
    src = Path(__file__).parents[1] / "results" / "study" / "S2" / "compare" / "report.json"
    rep = json.loads(src.read_text())
    assert "edge of the sweep's grid" not in render_markdown(rep)
    rep["lrs"] = lrs
    assert "- **At the edge of the sweep's grid:** nonlinear: the lowest val loss" in \
        render_markdown(rep)


def test_sweep_needs_two_seeds(tmp_path):
    p, _ = sweep(tmp_path, tmp_path / "s1", seeds="1")
    assert_user_error(p, "--seeds must be >= 2")


@pytest.mark.parametrize("argv, names", [
    (["reproduce", "--arms", " , ", "--preset", "tiny"], "--arms ' , ' names nothing"),
    (["study", "--rungs", ""], "--rungs '' names nothing"),
    (["reproduce", "--preset", "tiny", "--replicate-threads", "4"], "needs --replicates"),
    (["sweep", "--preset", "tiny", "--lrs", "1e-3,2e-3,4e-3", "--arms", "linear",
      "--set", "train.lr=5e-3"], "--set train.lr: a sweep sets the lr"),
])
def test_flags_that_would_be_ignored_are_errors(tmp_path, capsys, argv, names):
    """An empty list read as "all", a replicate thread count without replicates, an lr the
    sweep's grid replaces: each one error naming it, before any run."""
    from nlq.cli import main

    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert names in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_rung_that_sets_the_lr_is_refused(tmp_path):
    from nlq.experiments.ladder import load_ladder

    (tmp_path / "l.toml").write_text('experiment = "paper"\narms = ["linear", "nonlinear"]\n'
                                     '[rungs.A]\npreset = "tiny"\nlrs = [1e-3, 2e-3, 4e-3]\n'
                                     'set = { "train.min_lr" = 1e-4 }\n')
    with pytest.raises(NlqError, match="rungs.A.set: train.min_lr is what the rung's sweep"):
        load_ladder(tmp_path / "l.toml")


def test_report_experiment_none_reads_no_claims(tmp_path):
    """--experiment none (documented: neither an ordering nor the paper's figures)."""
    from test_report import declare_paper, make_run

    from nlq.cli import main

    for k in range(2):
        make_run(tmp_path / "exp", "linear", k, [9.0, 6.0, 5.0, 4.5 + 0.01 * k])
        make_run(tmp_path / "exp", "nonlinear", k, [9.0, 6.0, 5.0, 4.4],
                 {"model.query": "nonlinear"})
    declare_paper(tmp_path / "exp")  # an experiment.toml that would give claims
    assert main(["report", str(tmp_path / "exp"), "--experiment", "none", "--out",
                 str(tmp_path / "r")]) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["ordering"] is None and rep["paper"] is None and not rep["preregistered"]
