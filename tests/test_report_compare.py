"""The comparison a report can trust: Holm's correction, the two-level bootstrap, the
positive-control gate (no verdict when more parameters do not help), the bigram reference,
and numbers from the test split."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_report import declare_paper, make_run

from nlq.report.bootstrap import paired_bootstrap
from nlq.report.compare import control_line, holm, outcome
from nlq.report.references import Bigram
from nlq.report.report import build_report, summary_lines
from nlq.report.stats import detectable, mean_ci, seeds_for_power


def add_test(d, doc_nats: list[float], doc_tokens: list[int], spikes=()):
    """Give a fake run a test split: test_docs.json and the summary's test_* keys."""
    s = json.loads((d / "summary.json").read_text())
    loss = sum(doc_nats) / sum(doc_tokens)
    s |= {"test_loss": loss, "test_ppl": math.exp(loss), "test_tokens": sum(doc_tokens),
          "test_docs": len(doc_nats), "spikes": list(spikes), "n_spikes": len(spikes)}
    (d / "summary.json").write_text(json.dumps(s))
    (d / "test_docs.json").write_text(json.dumps(
        {"doc": list(range(len(doc_nats))), "nats": doc_nats, "tokens": doc_tokens}))


def experiment(tmp_path, gain_wide: float, gain_nl: float, seeds: int = 4, control=True):
    """linear, linear+12.5% and nonlinear runs whose test loss per document is the linear
    one times (1 + gain) plus a little per-seed noise."""
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(200, 400, size=30)]
    for k in range(seeds):
        base = rng.uniform(3.0, 4.0, size=30) * np.array(tokens)
        for arm, gain in (("linear", 0.0), ("linear+12.5%", gain_wide), ("nonlinear", gain_nl)):
            nats = base * (1 + gain + rng.normal(0, 0.001))
            d = make_run(tmp_path / "exp", arm, k, [9.0, 6.0, 5.0, 4.5],
                         {"model.query": "nonlinear"} if arm == "nonlinear" else None)
            add_test(d, nats.tolist(), tokens,
                     spikes=[{"step": 7, "kind": "loss", "value": 9.0, "ref": 5.0}]
                     if (arm, k) == ("nonlinear", 1) else ())
    return declare_paper(tmp_path / "exp", control=control)


def test_holm_matches_a_hand_computation():
    comps = [{"p": 0.01, "per_seed_pct": [1.0, 2.0, 3.0]},
             {"p": 0.04, "per_seed_pct": [1.0, 1.5, 2.0]},
             {"p": 0.03, "per_seed_pct": [0.5, 1.0, 2.0]}]
    holm(comps)
    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01, max(0.03, 2 x 0.03), max(0.06, 1 x 0.04); the
    # step-down stops at 0.03 (0.06 >= 0.05), so 0.04 keeps that step's level, not 1 - 0.05
    assert [c["p_holm"] for c in comps] == pytest.approx([0.03, 0.06, 0.06])
    assert [c["holm_level"] for c in comps] == pytest.approx([1 - 0.05 / 3, 1 - 0.05 / 2,
                                                             1 - 0.05 / 2])
    e = mean_ci([1.0, 2.0, 3.0], 1 - 0.05 / 3)
    assert comps[0]["ci_holm"] == pytest.approx([e.lo, e.hi])


def test_holm_gives_no_verdict_after_the_step_down_stops():
    """Two comparisons with raw p 0.02-0.05 (t-tests over 6 seeds): Holm rejects neither
    (the smaller one fails at 0.025), so neither Holm interval may exclude 0, though the
    larger one's would at its own step's 95% level."""
    st = pytest.importorskip("scipy.stats")
    comps = []
    for d in ([1.0, 1.6, 0.1, 2.2, -0.1, 1.3], [0.9, 1.9, 0.1, 2.4, -0.1, 1.6]):
        p = st.ttest_1samp(d, 0.0).pvalue
        comps.append({"arm": "a", "against": "b", "p": p, "per_seed_pct": d,
                      "ci95": [mean_ci(d).lo, mean_ci(d).hi]})
    p1, p2 = sorted(c["p"] for c in comps)
    assert 0.025 < p1 < p2 < 0.05  # the case: each excludes 0 at 95%
    holm(comps)
    for c in comps:
        assert c["p_holm"] >= 0.05
        assert c["holm_level"] == pytest.approx(0.975)
        assert c["ci_holm"][0] < 0 < c["ci_holm"][1]
        assert outcome(c) == "none"


def test_bootstrap_is_centred_on_identical_arms_and_narrows_with_documents():
    rng = np.random.default_rng(1)
    widths = []
    for D in (20, 320):
        tok = rng.integers(100, 300, size=(6, D)).astype(float)
        nats = rng.uniform(3, 4, size=(6, D)) * tok
        same = paired_bootstrap(nats, nats, tok)
        assert same["mean"] == 0 and same["lo"] == same["hi"] == 0
        noisy = nats * (1 + rng.normal(0, 0.02, size=(6, D)))
        b = paired_bootstrap(noisy, nats, tok)
        assert b["lo"] < b["mean"] < b["hi"]
        widths.append(b["hi"] - b["lo"])
    assert widths[1] < widths[0] / 2  # 16x the documents: about 4x narrower


def test_bootstrap_draws_one_set_of_test_units_for_all_seeds():
    """Every seed is scored on the same test split, so its sampling error is shared: 16 copies
    of one seed carry no more information about the test split than the seed alone, and the
    interval must not narrow (drawing units seed by seed made it 4x narrower)."""
    rng = np.random.default_rng(5)
    D = 200
    tok = rng.integers(50, 300, D).astype(float)
    per_tok = 3 + rng.normal(0, 0.3, D)
    a1 = (per_tok * (1 + rng.normal(-0.002, 0.03, D)) * tok)[None]  # (1, D)
    b1, t1 = (per_tok * tok)[None], tok[None]
    one = paired_bootstrap(a1, b1, t1)
    copies = paired_bootstrap(*(np.repeat(x, 16, axis=0) for x in (a1, b1, t1)))  # (16, D)
    ratio = (copies["hi"] - copies["lo"]) / (one["hi"] - one["lo"])
    assert 0.85 < ratio < 1.15, ratio
    assert copies["mean"] == pytest.approx(one["mean"])


def test_identical_arms_give_no_verdict_and_leave_holm_to_the_rest():
    """Bit-identical arms have per-seed differences all 0: no t-test (a NaN p would stop Holm
    at it and depend on the order the pairs are listed in); the pair still counts in m, a pair
    with an arm that was not run does not."""
    from nlq.report.compare import compare
    from nlq.report.runs import Run

    rng = np.random.default_rng(2)
    base = 3 + rng.normal(0, 0.02, 5)
    losses = {"b": base, "same": base, "good1": base - 0.02 + rng.normal(0, 0.002, 5),
              "good2": base - 0.03 + rng.normal(0, 0.002, 5)}
    by_arm = {a: [Run(dir=Path("/nonexistent"), arm=a, seed=i, summary={"val_loss": float(v)})
                  for i, v in enumerate(vals)] for a, vals in losses.items()}
    results = []
    for order in (["same", "good1", "good2"], ["good1", "good2", "same"]):
        comps = {a: compare(a, "b", by_arm, False) for a in order + ["not-run"]}
        holm(list(comps.values()))
        assert comps.pop("not-run")["absent"]  # an arm left out: outside the family
        assert "no t-test" in comps["same"]["problem"] and outcome(comps["same"]) == "no verdict"
        results.append({a: (c.get("p_holm"), outcome(c)) for a, c in comps.items()})
        assert all(results[-1][a][1] == "beats" and results[-1][a][0] < 0.05
                   for a in ("good1", "good2"))
        # the pair with no t-test still counts in the pre-registered family: m = 3
        first = min((comps["good1"], comps["good2"]), key=lambda c: c["p"])
        assert first["p_holm"] == pytest.approx(3 * first["p"])
        assert first["holm_level"] == pytest.approx(1 - 0.05 / 3)
    assert results[0] == results[1]


def test_control_failing_gives_no_verdict_anywhere(tmp_path):
    exp = experiment(tmp_path, gain_wide=0.0, gain_nl=-0.02)
    rep = build_report([exp], tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert rep["split"] == "test"
    assert rep["first_line"].startswith("This setting cannot test the claim: more parameters "
                                        "(linear+12.5%) do not reliably beat linear here")
    assert md.splitlines()[2] == f"**{rep['first_line']}**"  # right under the title
    # a planning figure: what these seeds detect, from the control's own numbers
    c = rep["positive_control"]
    assert c["detectable_80_pct"] == pytest.approx(detectable(c["sd_pct"], c["n_seeds"]))
    if c["mean_pct"] < 0:
        assert (f"{c['n_seeds']} seeds detect a difference of {c['detectable_80_pct']:.2f}% "
                f"with 80% power") in rep["first_line"]
    else:  # more parameters did worse: no effect size to plan for
        assert "80% power" not in rep["first_line"]
    text = md + "\n".join(summary_lines(rep))
    for claim in ("beats", "is worse than", "no detectable difference", "holds here",
                  "## Verdicts"):
        assert claim not in text.replace("Positive control passed", ""), claim
    assert summary_lines(rep)[0] == rep["first_line"]
    assert rep["preregistered_verdicts"] == []
    # the numbers stay, as descriptions
    assert any("descriptive" in r for r in rep["arms"])


def test_control_passing_gives_holm_verdicts_with_bootstrap(tmp_path):
    exp = experiment(tmp_path, gain_wide=-0.01, gain_nl=-0.02)
    rep = build_report([exp], tmp_path / "out")
    assert rep["first_line"].startswith("Positive control passed: linear+12.5% beats linear")
    nl_vs_lin, nl_vs_wide = rep["preregistered"]
    for c, want in ((nl_vs_lin, -2.0), (nl_vs_wide, 100 * (0.98 / 0.99 - 1))):
        assert c["mean_pct"] == pytest.approx(want, abs=0.2)
        assert c["bootstrap"]["lo"] < c["mean_pct"] < c["bootstrap"]["hi"] < 0
        assert c["half_width_95_pct"] == pytest.approx((c["ci95"][1] - c["ci95"][0]) / 2)
        assert c["sd_pct"] == pytest.approx(np.std(c["per_seed_pct"], ddof=1))
    v = rep["preregistered_verdicts"]
    assert v[0].startswith(f"nonlinear beats linear: {nl_vs_lin['mean_pct']:+.2f}% log-loss, "
                           f"Holm-adjusted")
    assert v[1].startswith("nonlinear beats linear+12.5%")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Verdicts" in md and "nonlinear seed 1: 1 spike(s) at step 7 (loss)" in md
    assert "1 spike(s) in 1 run(s): 1 of train loss, 0 of grad norm; 0 inside" in md


def test_no_difference_is_said_as_such(tmp_path):
    exp = experiment(tmp_path, gain_wide=-0.01, gain_nl=0.0)
    rep = build_report([exp], tmp_path / "out")
    assert rep["preregistered_verdicts"][0].startswith(
        "no detectable difference between nonlinear and linear") or \
        rep["preregistered_verdicts"][0].startswith("nonlinear is worse")


def test_one_seed_cannot_pass_the_control(tmp_path):
    exp = experiment(tmp_path, gain_wide=-0.05, gain_nl=-0.05, seeds=1)
    rep = build_report([exp], tmp_path / "out")
    assert rep["first_line"] == ("This setting cannot test the claim: the positive control "
                                 "(linear+12.5% vs linear) could not be evaluated (1 paired "
                                 "seed(s): an interval needs at least 2).")


def test_bigram_reference_equals_a_brute_force_count():
    rng = np.random.default_rng(3)
    V = 7
    train, split = rng.integers(0, V, 500), rng.integers(0, V, 80)
    k = 0.3
    pair = np.zeros((V, V))
    for a, b in itertools.pairwise(train):
        pair[a, b] += 1
    want = -np.mean([np.log((pair[a, b] + k) / (pair[a].sum() + k * V))
                     for a, b in itertools.pairwise(split)])
    assert Bigram(train, V).loss(split, k) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("gain_wide, gain_nl, status, phrase", [
    (-0.01, -0.02, "holds", "holds here: the intervals separate the three arms"),
    (-0.02, -0.01, "contradicted", ("does not hold here: the interval of nonlinear vs "
                                    "linear+12.5% lies above 0")),
    (-0.01, -0.01, "unresolved", "is neither confirmed nor contradicted here"),
])
def test_ordering_is_judged_by_intervals_not_by_means(tmp_path, gain_wide, gain_nl, status,
                                                      phrase):
    """Equal gains rank the means somehow; only separated intervals say holds / does not."""
    rep = build_report([experiment(tmp_path, gain_wide, gain_nl)], tmp_path / "out")
    o = rep["ordering"]
    assert o["status"] == status and phrase in o["answer"], o["answer"]
    if status == "unresolved":
        assert "does not hold" not in o["answer"] and "holds here" not in o["answer"]


def test_a_failed_control_line_gives_its_planning_figures_only_on_the_expected_side():
    """S0's control numbers: 8 seeds detect 1.30% (80% power); its mean size needs ~15. A
    control whose wider arm did worse gets no effect size to plan for."""
    c = {"arm": "wide", "against": "base", "n_seeds": 8, "mean_pct": -0.893, "sd_pct": 1.125,
         "ci95": [-1.833, 0.048], "detectable_80_pct": detectable(1.125, 8)}
    line = control_line(c)
    assert line.startswith("This setting cannot test the claim")
    assert ("With its paired sd (1.12%), 8 seeds detect a difference of 1.30% with 80% power; "
            "an effect of its mean size (0.89%) needs ~15 seeds") in line
    assert seeds_for_power(-0.893, 1.125) == 15
    worse = control_line(c | {"mean_pct": 0.4, "ci95": [-0.5, 1.3]})
    assert "power" not in worse and worse.endswith("8 seeds).")
