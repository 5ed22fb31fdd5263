"""nlq.report.report and `nlq report`: numbers recomputed from synthetic run dirs, Fig. 1, CLI."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import matplotlib
import matplotlib.image
import pytest

from nlq.config import load_config
from nlq.experiments.experiment import experiment_toml, load_experiment
from nlq.report.report import build_report
from nlq.report.runs import collect

T975_1 = 12.706204736174707  # t_{0.975, 1}: two seeds -> 1 degree of freedom
STEPS = [0, 10, 20, 30]
_T = load_config("tiny")
TOK_PER_STEP = _T.train.micro_batch * _T.train.grad_accum * _T.model.block_size


def make_run(root: Path, arm: str, seed: int, losses: list[float], overrides=None,
             finished=True, arm_json=True, data_dir=None) -> Path:
    """A run dir as the trainer and the experiment runner write it."""
    d = root / "runs" / arm / f"seed{seed}"
    d.mkdir(parents=True)
    sets = {"train.seed": 1337 + seed, **(overrides or {})}
    if data_dir:
        sets["data.dir"] = str(data_dir)
    (d / "config.toml").write_text(load_config("tiny").replace(**sets).to_toml())
    lines = []
    for step, loss in zip(STEPS, losses):
        if step:
            lines.append({"kind": "train", "step": step, "lr": 1e-3, "loss": loss + 0.05,
                          "grad_norm": 1.0, "tokens": step * TOK_PER_STEP, "tok_per_s": 1e4,
                          "elapsed": step * 0.1})
        lines.append({"kind": "eval", "step": step, "val_loss": loss, "val_ppl": math.exp(loss),
                      "tokens": step * TOK_PER_STEP, "elapsed": step * 0.1})
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if arm_json:
        (d / "arm.json").write_text(json.dumps({"experiment": "t", "arm": arm, "seed_index": seed}))
    if finished:
        n = len(losses)
        params = {"linear": (3_000_000, 1_000_000), "nonlinear": (3_100_000, 1_100_000)}
        total, ne = params.get(arm, (3_000_000, 1_000_000))
        (d / "summary.json").write_text(json.dumps({
            "status": "finished", "step": STEPS[n - 1], "tokens": STEPS[n - 1] * TOK_PER_STEP,
            "val_loss": losses[-1], "val_ppl": math.exp(losses[-1]), "params_total": total,
            "params_non_embedding": ne, "elapsed_s": 3.0, "tok_per_s": 1e4}))
    return d


LOSSES = {  # arm -> seed -> eval losses at STEPS
    "linear": {0: [9.0, 6.0, 5.0, 4.50], 1: [9.0, 6.1, 5.1, 4.60]},
    "nonlinear": {0: [9.0, 5.9, 4.9, 4.40], 1: [9.0, 6.0, 5.0, 4.55]},
}


def declare_paper(exp: Path, control: bool = False) -> Path:
    """exp/experiment.toml as `nlq reproduce` writes it for the paper experiment: the report
    reads the paper's ordering and figures from there. control=False drops the positive
    control, so that these synthetic runs (no linear+12.5% arm) get verdicts: the tests of
    the gate itself are in test_report_compare.py."""
    exp.mkdir(parents=True, exist_ok=True)
    paper = load_experiment("paper")
    if not control:
        paper = dataclasses.replace(paper, claims=dataclasses.replace(paper.claims,
                                                                      positive_control=None))
    (exp / "experiment.toml").write_text(experiment_toml(paper))
    return exp


def data_meta(data: Path) -> Path:
    """A data dir with only meta.json: described in the report, no unigram reference."""
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"tokenizer": "bpe:8192", "vocab_size": 8192,
                                                "dtype": "uint16", "train_tokens": 123456,
                                                "val_tokens": 6789}))
    return data


@pytest.fixture
def experiment(tmp_path):
    data = data_meta(tmp_path / "data")
    exp = tmp_path / "exp"
    for arm, seeds in LOSSES.items():
        for seed, losses in seeds.items():
            make_run(exp, arm, seed, losses,
                     {"model.query": arm} if arm != "linear" else None, data_dir=data)
    # a third nonlinear seed that stopped at step 20: listed, not counted
    make_run(exp, "nonlinear", 2, [9.0, 6.0, 5.0], {"model.query": "nonlinear"},
             finished=False, data_dir=data)
    return declare_paper(exp)


def final_losses(exp: Path, arm: str) -> dict[int, float]:
    """The last eval line of each finished run's metrics.jsonl, read by the test itself."""
    out = {}
    for d in sorted((exp / "runs" / arm).iterdir()):
        if not (d / "summary.json").exists():
            continue
        evals = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        evals = [e for e in evals if e["kind"] == "eval"]
        out[json.loads((d / "arm.json").read_text())["seed_index"]] = evals[-1]["val_loss"]
    return out


def ci2(xs):
    m = sum(xs) / 2
    half = T975_1 * abs(xs[0] - xs[1]) / math.sqrt(2) / math.sqrt(2)  # sd = |a-b|/sqrt(2)
    return m, m - half, m + half


def test_report_numbers_recomputed_from_metrics(experiment, tmp_path):
    backend = matplotlib.get_backend()
    rep = build_report([experiment], tmp_path / "out", title="synthetic")
    assert matplotlib.get_backend() == backend  # drawn on an Agg canvas, pyplot untouched
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved == json.loads(json.dumps(rep))
    arms = {a["arm"]: a for a in saved["arms"]}
    assert list(arms) == ["linear", "nonlinear"]  # baseline first

    base, nl = final_losses(experiment, "linear"), final_losses(experiment, "nonlinear")
    for name, fin in (("linear", base), ("nonlinear", nl)):
        a = arms[name]
        m, lo, hi = ci2(list(fin.values()))
        assert a["n_seeds"] == 2 and a["seeds"] == [0, 1]
        assert a["val_loss"]["mean"] == pytest.approx(m)
        assert a["val_loss"]["lo"] == pytest.approx(lo) and a["val_loss"]["hi"] == pytest.approx(hi)
        assert a["val_ppl_mean"] == pytest.approx(sum(math.exp(x) for x in fin.values()) / 2)
        assert a["tokens_per_run"] == 30 * TOK_PER_STEP and a["tokens_per_step"] == TOK_PER_STEP

    vs = arms["nonlinear"]["vs_baseline"]
    d = [100 * (nl[s] - base[s]) / base[s] for s in (0, 1)]
    m, lo, hi = ci2(d)
    e = e_ll = vs["log_loss_pct"]
    assert (e["mean"], e["lo"], e["hi"], e["n"]) == (
        pytest.approx(m), pytest.approx(lo), pytest.approx(hi), 2)
    # perplexity: exp of the interval of the log-loss difference (in nats), never below -100%
    m, lo, hi = ci2([nl[s] - base[s] for s in (0, 1)])
    e = vs["ppl_pct"]
    assert (e["mean"], e["lo"], e["hi"]) == (pytest.approx(100 * math.expm1(m)),
                                             pytest.approx(100 * math.expm1(lo)),
                                             pytest.approx(100 * math.expm1(hi)))
    assert e["lo"] > -100
    assert arms["nonlinear"]["params_non_embedding_vs_baseline_pct"] == pytest.approx(10.0)
    assert arms["nonlinear"]["params_total_vs_baseline_pct"] == pytest.approx(100 / 30)
    # an arm's row against the baseline is a description; its verdict, if any, is the
    # pre-registered comparison's (the Holm family's)
    assert "verdict" not in arms["nonlinear"] and arms["nonlinear"]["preregistered"]
    assert arms["nonlinear"]["descriptive"] == (
        f"nonlinear: mean log-loss {e_ll['mean']:+.2f}% vs linear, paired 95% CI "
        f"{e_ll['lo']:+.2f}..{e_ll['hi']:+.2f}%, 2 seeds")
    assert saved["preregistered_verdicts"][0].startswith(
        "no detectable difference between nonlinear and linear")

    assert saved["data"]["meta"][str(tmp_path / "data")]["tokenizer"] == "bpe:8192"
    [inc] = saved["incomplete"]
    assert inc["arm"] == "nonlinear" and inc["seed"] == 2 and inc["last_eval_step"] == 20
    assert "no summary.json" in inc["reason"]

    md = (tmp_path / "out" / "report.md").read_text()
    assert "Incomplete runs (excluded from the statistics)" in md and "seed2" in md
    assert "bpe:8192" in md and f"Tokens per run: {30 * TOK_PER_STEP:,}" in md
    assert "arXiv 2603.13381" in md and "cannot be checked here" in md

    png = tmp_path / "out" / "fig1.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(png)
    assert img.ndim == 3 and img.shape[0] > 500 and img.shape[1] > 500 and img.shape[2] in (3, 4)


def ordering_runs(exp: Path, data_dir: Path | None = None) -> Path:
    """Five arms: three seeds of linear, linear+12.5%, nonlinear and a QK-norm arm qk, one
    seed of identity."""
    qk_noise = (0.01, -0.012, 0.003)  # nonlinear - qk = -0.01, +0.012, -0.003: spans 0
    for seed, shift in ((0, 0.0), (1, 0.02), (2, -0.01)):
        make_run(exp, "linear", seed, [9, 6, 5, 4.50 + shift], data_dir=data_dir)
        make_run(exp, "linear+12.5%", seed, [9, 6, 5, 4.45 + shift],
                 {"model.mlp_hidden": 1152}, data_dir=data_dir)
        make_run(exp, "nonlinear", seed, [9, 6, 5, 4.40 + shift], {"model.query": "nonlinear"},
                 data_dir=data_dir)
        make_run(exp, "qk", seed, [9, 6, 5, 4.40 + shift + qk_noise[seed]],
                 {"model.qk_norm": True}, data_dir=data_dir)
    make_run(exp, "identity", 0, [9, 6, 5, 4.6], {"model.query": "identity"}, data_dir=data_dir)
    return exp


def test_one_seed_ordering_and_strong_baseline(tmp_path):
    exp = declare_paper(ordering_runs(tmp_path / "exp"))
    rep = build_report([exp], tmp_path / "out")
    arms = {a["arm"]: a for a in rep["arms"]}
    assert arms["identity"]["descriptive"] == ("identity: 1 seed: no interval, a single "
                                               "observation (log-loss 2.22% above linear)")
    assert arms["identity"]["val_loss"]["lo"] is None
    assert arms["nonlinear"]["descriptive"].startswith("nonlinear: mean log-loss -2.22% vs "
                                                       "linear, paired 95% CI ")
    # without the positive control (declare_paper drops it), linear+12.5% vs linear is no
    # pre-registered comparison: the ordering is described, whatever its intervals show
    o = rep["ordering"]
    assert o["holds_in_means"] and o["separated_by_intervals"] and o["status"] == "described"
    assert o["arms"] == ["nonlinear", "linear+12.5%", "linear"]
    assert "linear+12.5% vs linear is not a pre-registered comparison" in o["answer"]
    # nonlinear vs qk is not pre-registered either: described
    [s] = rep["strong_baseline"]
    assert s["strong_baseline"] == "qk" and s["survives"].startswith("described")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "(1 seed, no CI)" in md and "holds here" not in md and "QK-norm baseline qk" in md


def test_no_gain_over_the_baseline_has_none_to_survive(tmp_path):
    """nonlinear no better than linear, both clearly better than qk: "yes, it survives" would
    claim a gain that is not there; the answer says so and only describes the pair. Both
    pairs are pre-registered here: outside the Holm family the pair is only described."""
    from nlq.report.claims import Claims

    exp, data_dir = tmp_path / "exp", None
    for seed, shift in ((0, 0.0), (1, 0.02), (2, -0.01)):
        noise = (0.01, -0.012, 0.003)[seed]  # nonlinear - linear spans 0
        make_run(exp, "linear", seed, [9, 6, 5, 4.50 + shift], data_dir=data_dir)
        make_run(exp, "nonlinear", seed, [9, 6, 5, 4.50 + shift + noise],
                 {"model.query": "nonlinear"}, data_dir=data_dir)
        make_run(exp, "qk", seed, [9, 6, 5, 4.70 + shift], {"model.qk_norm": True},
                 data_dir=data_dir)
    family = Claims(comparisons=(("nonlinear", "linear"), ("nonlinear", "qk")))
    [s] = build_report([exp], tmp_path / "out", claims=family)["strong_baseline"]
    assert s["survives"].startswith("no gain over linear is shown here")
    assert "vs qk, paired 95% CI" in s["answer"]
    [s] = build_report([exp], tmp_path / "bare")["strong_baseline"]
    assert s["survives"] == ("described (nonlinear vs linear and nonlinear vs qk: not a "
                             "pre-registered comparison)")
    # both pairs pre-registered, but a failed positive control (qk does not beat linear)
    # allows no verdict: described, and not mislabelled as outside the family
    failed = Claims(comparisons=family.comparisons, positive_control=("qk", "linear"))
    rep = build_report([exp], tmp_path / "failed", claims=failed)
    [s] = rep["strong_baseline"]
    assert not rep["verdicts_allowed"]
    assert s["survives"] == "described (pre-registered, but no verdict: see the positive control)"


GOLDEN_MD = Path(__file__).parent / "golden" / "report_synthetic.md"


def synthetic_report(tmp_path: Path) -> str:
    """report.md of a fixed set of runs (every section but Notes), paths written as <TMP>."""
    data = data_meta(tmp_path / "data")
    exp = declare_paper(ordering_runs(tmp_path / "exp", data))
    make_run(exp, "nonlinear", 3, [9.0, 6.0], {"model.query": "nonlinear"}, finished=False,
             data_dir=data)
    build_report([exp], tmp_path / "out", title="synthetic")
    return (tmp_path / "out" / "report.md").read_text().replace(str(tmp_path), "<TMP>")


def test_markdown_of_fixed_runs_is_unchanged(tmp_path):
    """Byte for byte tests/golden/report_synthetic.md (regenerated when the report's format
    changes on purpose: the positive control, pre-registered comparisons and stability)."""
    assert synthetic_report(tmp_path) == GOLDEN_MD.read_text()


def test_claims_come_only_from_the_experiment(tmp_path):
    """Runs of no declared experiment: no ordering line, no paper section; the same runs
    with --experiment paper get both, as with the experiment.toml that reproduce writes."""
    exp = ordering_runs(tmp_path / "exp")
    bare = build_report([exp], tmp_path / "bare")
    md = (tmp_path / "bare" / "report.md").read_text()
    assert bare["ordering"] is None and bare["paper"] is None
    assert "ordering" not in md and "paper" not in md and "2603.13381" not in md
    assert bare["strong_baseline"]  # the QK-norm question needs no declaration

    from nlq.cli import main

    assert main(["report", str(exp), "--experiment", "paper", "--out",
                 str(tmp_path / "declared")]) == 0
    declared = json.loads((tmp_path / "declared" / "report.json").read_text())
    # the paper experiment declares a positive control; these runs' linear+12.5% passes it
    assert declared["first_line"].startswith("Positive control passed: linear+12.5% beats")
    assert declared["ordering"]["holds_in_means"] and declared["verdicts_allowed"]
    assert declared["paper"] == load_experiment("paper").claims.reference
    declare_paper(exp)
    found = build_report([exp / "runs" / "linear" / "seed0", exp / "runs" / "nonlinear"],
                         tmp_path / "found")
    assert found["paper"] == declared["paper"]
    assert found["ordering"]["answer"].startswith("The paper's ordering nonlinear < "
                                                  "linear+12.5% < linear cannot be checked")


def test_run_without_arm_json_uses_folder_and_config_seed(tmp_path):
    make_run(tmp_path, "linear", 0, [9, 6, 5, 4.5], arm_json=False)
    [run] = collect([tmp_path / "runs" / "linear" / "seed0"])
    assert run.arm == "linear" and run.seed == 1337 and run.finished


def test_diverged_run_is_listed_not_counted(tmp_path):
    make_run(tmp_path, "linear", 0, [9, 6, 5, 4.5])
    d = make_run(tmp_path, "linear", 1, [9, 6, 5, 4.5])
    summary = json.loads((d / "summary.json").read_text())
    (d / "summary.json").write_text(json.dumps({**summary, "val_loss": float("nan")}))
    rep = build_report([tmp_path / "runs"], tmp_path / "out")
    assert rep["arms"][0]["n_seeds"] == 1
    [inc] = rep["incomplete"]
    assert inc["seed"] == 1 and "not a finite number" in inc["reason"]


def test_errors(tmp_path, experiment):
    from nlq.errors import NlqError

    with pytest.raises(NlqError, match="baseline arm 'qk' has no finished run"):
        build_report([experiment], tmp_path / "o", baseline="qk")
    only_incomplete = tmp_path / "inc"
    make_run(only_incomplete, "linear", 0, [9, 6], finished=False)
    with pytest.raises(NlqError, match="no finished run"):
        build_report([only_incomplete], tmp_path / "o")


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "nlq", "report", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=120,
                          check=False)


def test_cli_report(experiment, tmp_path, capsys):
    r = run_cli(experiment, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (experiment / "report.md").is_file() and (experiment / "fig1.png").is_file()
    assert "no detectable difference between nonlinear and linear" in r.stdout

    from nlq.cli import main

    assert main(["report", str(experiment), "--baseline", "nope", "--out",
                 str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("nlq: error: baseline arm 'nope'")
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli(empty, "--out", tmp_path / "o", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("nlq: error: no run in")


@pytest.mark.parametrize("raw,match", [
    ({"hypothesis": {"ordering": ["nonlinear"]}}, "2 or more distinct"),
    ({"hypothesis": {"ordering": ["a", "a"]}}, "2 or more distinct"),
    ({"hypothesis": {"order": ["a", "b"]}}, r"\[hypothesis\] holds ordering, comparisons"),
    ({"reference": {"cite": "x", "setting": "y"}}, "figures"),
    ({"reference": {"cite": "x", "setting": "y", "figures": [{"arm": "a"}]}}, "version"),
    ({"reference": {"cite": "x", "setting": "y",
                    "figures": [{"version": "v", "arm": "a", "val_loss": "2.9"}]}}, "val_loss"),
])
def test_bad_claims_name_the_key(raw, match):
    from nlq.errors import NlqError
    from nlq.report.claims import claims_from_dict

    with pytest.raises(NlqError, match=match):
        claims_from_dict(raw, "e.toml")


def test_runs_of_experiments_with_different_claims_need_a_choice(tmp_path):
    from nlq.errors import NlqError

    a = declare_paper(tmp_path / "a")
    make_run(a, "linear", 0, [9, 6, 5, 4.5])
    b = tmp_path / "b"
    make_run(b, "linear", 1, [9, 6, 5, 4.6])
    (b / "experiment.toml").write_text('[hypothesis]\nordering = ["nonlinear", "linear"]\n')
    with pytest.raises(NlqError, match="--experiment"):
        build_report([a, b], tmp_path / "out")
    rep = build_report([a, b], tmp_path / "out", claims=load_experiment("encoder").claims)
    assert rep["ordering"]["arms"] == ["nonlinear", "linear+12.5%", "linear"]


def test_a_run_far_above_its_arm_is_flagged_and_kept(tmp_path):
    """Six linear seeds within 0.01 nats and one 0.4 above: report.json and report.md name that
    run with its robust z, and the arm's mean still counts it (flagged, never dropped)."""
    exp = tmp_path / "exp"
    finals = [4.50, 4.505, 4.495, 4.51, 4.49, 4.90, 4.50]
    for seed, f in enumerate(finals):
        make_run(exp, "linear", seed, [9, 6, 5, f])
        make_run(exp, "nonlinear", seed, [9, 6, 5, f - 0.02], {"model.query": "nonlinear"})
    rep = build_report([exp], tmp_path / "out")
    by_arm = {o["arm"]: o for o in rep["outliers"]}
    assert set(by_arm) == {"linear", "nonlinear"}  # the same slow seed in both arms
    o = by_arm["linear"]
    assert (o["seed"], o["loss"], o["median"]) == (5, 4.90, 4.50)
    assert o["robust_z"] == pytest.approx(0.40 / (1.4826 * 0.005))
    md = (tmp_path / "out" / "report.md").read_text()
    assert "- linear seed 5: 4.9000 (arm median 4.5000, robust z 54)" in md
    base = next(a for a in rep["arms"] if a["arm"] == "linear")
    assert base["val_loss"]["mean"] == pytest.approx(sum(finals) / len(finals))


def test_runs_on_different_val_sets_are_noted(tmp_path):
    """The val set is eval_batches x micro_batch windows: an arm run at another micro_batch
    (as an out-of-memory message suggests) reports val losses over other sequences."""
    for k in range(2):
        make_run(tmp_path / "exp", "linear", k, [9.0, 6.0, 5.0, 4.5])
        make_run(tmp_path / "exp", "nonlinear", k, [9.0, 6.0, 5.0, 4.4],
                 {"model.query": "nonlinear", "train.micro_batch": 2, "train.grad_accum": 2})
    rep = build_report([tmp_path / "exp"], tmp_path / "out")
    [note] = [n for n in rep["notes"] if "different val sets" in n]
    assert "val losses are not over the same sequences" in note
    same = build_report([tmp_path / "exp" / "runs" / "linear"], tmp_path / "out2")
    assert not [n for n in same["notes"] if "val sets" in n]


def test_a_seed_without_a_partner_is_named_in_the_comparison_it_leaves(tmp_path):
    """nonlinear's seed 2 has no finished linear+12.5% run: that pre-registered pair is over
    seeds 0-1, and the report says which seed left it."""
    for k in range(3):
        make_run(tmp_path / "exp", "linear", k, [9.0, 6.0, 5.0, 4.5 + 0.01 * k])
        make_run(tmp_path / "exp", "nonlinear", k, [9.0, 6.0, 5.0, 4.4 + 0.01 * k],
                 {"model.query": "nonlinear"})
        make_run(tmp_path / "exp", "linear+12.5%", k, [9.0, 6.0, 5.0, 4.45 - 0.02 * k],
                 finished=k < 2)
    rep = build_report([declare_paper(tmp_path / "exp")], tmp_path / "out")
    [c] = [c for c in rep["preregistered"] if c["against"] == "linear+12.5%"]
    assert c["n_seeds"] == 2 and c["unpaired"] == {"nonlinear": [2], "linear+12.5%": []}
    assert any(n.startswith("nonlinear vs linear+12.5%: seed(s) [2] of nonlinear")
               for n in rep["notes"])


def test_bad_destinations_and_files_are_named(tmp_path, capsys):
    """A file where a folder goes, a missing experiment file, an unknown [reference] key:
    each named (they read as "File exists ... check the path and free space", or an unknown
    shipped experiment)."""
    from nlq.cli import main
    from nlq.errors import NlqError
    from nlq.report.claims import claims_from_dict

    for k in range(2):
        make_run(tmp_path / "exp", "linear", k, [9.0, 6.0, 5.0, 4.5])
    (tmp_path / "afile").write_text("x")
    for argv, names in ((["report", str(tmp_path / "exp"), "--out", str(tmp_path / "afile")],
                         "is a file"),
                        (["export", str(tmp_path / "exp"), str(tmp_path / "afile")],
                         "is a file"),
                        (["params", "--experiment", str(tmp_path / "missing.toml")],
                         "experiment file")):
        assert main(argv) == 2, argv
        assert names in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "x"
    with pytest.raises(NlqError, match=r"unknown or missing: bogus"):
        claims_from_dict({"reference": {"cite": "c", "setting": "s", "figures": [{}],
                                        "bogus": 2}}, "exp.toml")
