"""`nlq reproduce` end to end on a miniature experiment (2 arms x 2 seeds, a few steps)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import assert_user_error, make_data, metrics, nlq, ok, snapshot

from nlq.config import load_config
from nlq.errors import NlqError
from nlq.experiments.experiment import (
    experiment_arms,
    experiment_toml,
    load_experiment,
    shipped_experiments,
)
from nlq.report.stats import mean_ci, paired

EXPERIMENT = """
name = "mini"
baseline = "linear"
[base]
train.max_steps = 6
[arms.linear]
[arms.nonlinear]
model.query = "nonlinear"
lr_scale = 1.5
"""

SETS = ["model.vocab_size=320", "model.block_size=16", "model.n_layer=1", "model.n_head=2",
        "model.d_model=32", "model.mlp_hidden=64", "train.micro_batch=4", "train.grad_accum=2",
        "train.eval_interval=2", "train.eval_batches=2", "train.warmup_steps=2",
        "train.ckpt_interval=2", "train.log_interval=1"]


def mini_setting(tmp_path):
    """The mini experiment's file and the --set arguments of its data (made once per test)."""
    data = tmp_path / "data"
    if not (data / "meta.json").is_file():
        make_data(data)
    exp = tmp_path / "mini.toml"
    exp.write_text(EXPERIMENT)
    return exp, [a for s in SETS + [f'data.dir="{data}"'] for a in ("--set", s)]


def reproduce(tmp_path, out, **env):
    exp, sets = mini_setting(tmp_path)
    return nlq("reproduce", "--experiment", exp, "--seeds", "2", "--out", out, "--jobs", "2",
               *sets, timeout=600, **env)


def tmp_experiment(out):
    return out.parent / "mini.toml"


@pytest.mark.parametrize("name", shipped_experiments())
def test_written_experiment_reads_back_the_same(name, tmp_path):
    """OUT/experiment.toml: arms written out as recipes and claims as tables, so a report
    or a rerun needs neither arms.toml nor the experiment it referred to."""
    exp = load_experiment(name)
    (tmp_path / "e.toml").write_text(experiment_toml(exp))
    assert load_experiment(tmp_path / "e.toml") == exp


def test_experiment_arm_names_come_from_arms_toml(tmp_path):
    p = tmp_path / "e.toml"
    p.write_text('arms = ["linear", "nonlinaer"]\n')
    with pytest.raises(NlqError, match="unknown arm 'nonlinaer'"):
        load_experiment(p)
    p.write_text('arms = ["linear", "nonlinear", "linear+12.5%"]\nhypothesis = "encoder"\n'
                 'reference = "encoder"\n')
    exp = load_experiment(p)
    assert exp.claims == load_experiment("paper").claims  # encoder declares paper's claims
    p.write_text('arms = ["linear", "nonlinear"]\nhypothesis = "paper"\n')
    with pytest.raises(NlqError, match="names arm 'linear\\+12.5%'"):
        load_experiment(p)


def test_a_set_that_the_experiment_would_undo_is_refused(tmp_path):
    """--set train.max_steps=8 under a [base] that sets 6 (or a key an arm's recipe sets) would
    run 6 steps silently: one error naming the key and who sets it, nothing written."""
    out = tmp_path / "out"
    for key, who in (("train.max_steps=8", "[base]"), ('model.query="identity"', "nonlinear")):
        exp, sets = mini_setting(tmp_path)
        p = nlq("reproduce", "--experiment", exp, "--seeds", "2", "--out", out, *sets,
                "--set", key)
        assert_user_error(p, key.split("=")[0], who)
        assert not out.exists()
    exp, sets = mini_setting(tmp_path)  # the same value as [base]: nothing undone, allowed
    arms = experiment_arms(load_experiment(exp), "tiny", {"train.max_steps": 6})
    assert {c.train.max_steps for c in arms.values()} == {6}


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("repro")
    out = tmp / "out"
    first = ok(reproduce(tmp, out))
    return tmp, out, first


def test_report_numbers_recomputed_from_run_dirs(experiment):
    _, out, _ = experiment
    rep = json.loads((out / "report.json").read_text())
    final, val = {}, {}
    for arm in ("linear", "nonlinear"):
        for k in (0, 1):
            run = out / "runs" / arm / f"seed{k}"
            evals = metrics(run, "eval")
            assert evals[-1]["step"] == 6
            summary = json.loads((run / "summary.json").read_text())
            assert summary["val_loss"] == evals[-1]["val_loss"]
            val[arm, k] = evals[-1]["val_loss"]
            docs = json.loads((run / "test_docs.json").read_text())
            final[arm, k] = sum(docs["nats"]) / sum(docs["tokens"])  # reported: test
    assert rep["split"] == "test"
    rows = {r["arm"]: r for r in rep["arms"]}
    for arm in ("linear", "nonlinear"):
        for key, src in (("loss", final), ("val_loss", val)):
            est = mean_ci([src[arm, 0], src[arm, 1]])
            got = rows[arm][key]
            assert got["mean"] == pytest.approx(est.mean, rel=1e-9)
            assert got["lo"] == pytest.approx(est.lo, rel=1e-9)
        assert rows[arm]["n_seeds"] == 2
    want = paired({k: final["nonlinear", k] for k in (0, 1)},
                  {k: final["linear", k] for k in (0, 1)})
    d = rows["nonlinear"]["vs_baseline"]["log_loss_pct"]
    assert d["mean"] == pytest.approx(want.log_loss().mean, rel=1e-9)
    assert d["lo"] == pytest.approx(want.log_loss().lo, rel=1e-9)
    per_seed = [100 * (final["nonlinear", k] - final["linear", k]) / final["linear", k]
                for k in (0, 1)]
    assert d["mean"] == pytest.approx(sum(per_seed) / 2, rel=1e-9)
    png = (out / "fig1.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "nonlinear" in (out / "report.md").read_text()
    # the experiment as run, next to its runs; it declares no ordering and no paper figures
    assert load_experiment(out / "experiment.toml") == load_experiment(tmp_experiment(out))
    assert rep["ordering"] is None and rep["paper"] is None


def test_arms_share_batches_and_pair_seeds(experiment):
    """Batches are a pure function of [data] and the batch shape (nlq/data/schedule.py):
    the runs of seed k have the same of both in every arm, and seed k has the same init seed
    in every arm; seeds differ in both."""
    _, out, _ = experiment
    cfgs = {(a, k): load_config(out / "runs" / a / f"seed{k}" / "config.toml")
            for a in ("linear", "nonlinear") for k in (0, 1)}
    for k in (0, 1):
        shape = {(c.data, c.train.micro_batch, c.train.grad_accum, c.model.block_size,
                  c.train.max_steps, c.train.eval_batches)
                 for (_, kk), c in cfgs.items() if kk == k}
        assert len(shape) == 1
        assert cfgs["linear", k].train.seed == cfgs["nonlinear", k].train.seed
    assert cfgs["linear", 0].data.seed != cfgs["linear", 1].data.seed
    assert cfgs["linear", 0].train.seed != cfgs["linear", 1].train.seed
    assert cfgs["nonlinear", 0].model.query == "nonlinear"
    assert cfgs["nonlinear", 0].train.lr == pytest.approx(1.5 * cfgs["linear", 0].train.lr)
    # same init seed, same batches, same arm: the step-0 eval of the two arms differs only
    # through the query, and two seeds of one arm start from different weights
    v0 = {key: metrics(out / "runs" / key[0] / f"seed{key[1]}", "eval")[0]["val_loss"]
          for key in cfgs}
    assert v0["linear", 0] != v0["linear", 1]


def test_exported_results_rebuild_the_same_report(experiment, tmp_path):
    """`nlq export` keeps no checkpoint and no per-step train line, yet `nlq report` on the
    copy gives the report the training folder gave: every number, spike and run."""
    _, out, _ = experiment
    dest = tmp_path / "results"
    ok(nlq("export", out, dest))
    assert not list(dest.rglob("ckpt")) and not list(dest.rglob("*.safetensors"))
    kinds = {json.loads(ln)["kind"] for ln in
             (dest / "runs/linear/seed0/metrics.jsonl").read_text().splitlines()}
    assert "train" not in kinds and "eval" in kinds
    ok(nlq("report", dest))
    a, b = (json.loads((d / "report.json").read_text()) for d in (out, dest))
    for rep in (a, b):
        rep.pop("title")
        rep["stability"].sort(key=lambda e: (e["arm"], e["seed"]))
    assert a == b  # run dirs are written relative to the report, so they match too
    assert not any(str(out) in ln for ln in (dest / "report.json").read_text().splitlines())
    p = nlq("export", tmp_path / "nowhere", tmp_path / "x")
    assert p.returncode == 2 and "holds no runs/ folder" in p.stderr


def test_stacked_seeds_are_the_lone_runs(experiment):
    """--stack 2: each arm's two seeds train as one stacked model (nlq/train/stack.py), into
    the same run dirs, to the lone runs' numbers up to float rounding (the lone runs use the
    CPU kernels, the stack the plain model)."""
    tmp, out, _ = experiment
    exp, sets = mini_setting(tmp)
    stacked = tmp / "out-stacked"
    p = ok(nlq("reproduce", "--experiment", exp, "--seeds", "2", "--out", stacked, "--jobs",
               "2", "--stack", "2", *sets, timeout=600))
    for arm in ("linear", "nonlinear"):
        runs = [(out / "runs" / arm / f"seed{k}", stacked / "runs" / arm / f"seed{k}")
                for k in (0, 1)]
        for lone, st in runs:
            a, b = (json.loads((d / "summary.json").read_text()) for d in (lone, st))
            assert b["stack"] == 2 and "stack" not in a
            assert b["test_loss"] == pytest.approx(a["test_loss"], rel=1e-4)
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4)
        assert "trained as one stack" in (runs[1][1] / "train.log").read_text()
    assert "all 4 runs finished already" in ok(nlq(
        "reproduce", "--experiment", exp, "--seeds", "2", "--out", stacked, "--jobs", "2",
        "--stack", "2", *sets, timeout=600)).stderr
    assert p.returncode == 0
    bad = nlq("reproduce", "--experiment", exp, "--seeds", "2", "--out", tmp / "x", "--stack",
              "0", *sets)
    assert_user_error(bad, "--stack")
    # a plan's runs are all stacked or all alone: either mix is refused, nothing written
    before = snapshot(stacked / "runs")
    for where, extra, how in ((stacked, [], "trained stacked"),
                              (out, ["--stack", "2"], "trained alone")):
        p = nlq("reproduce", "--experiment", exp, "--seeds", "2", "--out", where, *extra, *sets)
        assert_user_error(p, how)
    assert snapshot(stacked / "runs") == before


def test_second_invocation_trains_nothing(experiment):
    tmp, out, _ = experiment
    before = snapshot(out / "runs")
    p = ok(reproduce(tmp, out))
    assert "all 4 runs finished already" in p.stderr
    assert snapshot(out / "runs") == before


@pytest.mark.slow
def test_interrupted_experiment_resumes_to_the_same_numbers(experiment):
    tmp, out, _ = experiment
    out2 = tmp / "out-interrupted"
    p = reproduce(tmp, out2, NLQ_FAULT="step@4")  # every run is SIGKILLed after step 4
    assert p.returncode == 1
    assert not any((out2 / "runs").rglob("summary.json"))
    ok(reproduce(tmp, out2))
    a = {r["arm"]: r["val_loss"]["mean"]
         for r in json.loads((out / "report.json").read_text())["arms"]}
    b = {r["arm"]: r["val_loss"]["mean"]
         for r in json.loads((out2 / "report.json").read_text())["arms"]}
    assert a == b and all(math.isfinite(v) for v in a.values())
