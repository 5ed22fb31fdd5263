"""The report's numerical replicates (`nlq reproduce --replicates`): read as replicates, never
as seeds; the rounding-noise section recomputed by hand; a verdict that a change of summation
order flips is no finding; a bootstrap over chunks of the test stream where runs have them."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from test_report import declare_paper, make_run

from nlq.errors import NlqError
from nlq.report.bootstrap import paired_bootstrap
from nlq.report.claims import find_claims
from nlq.report.compare import outcome
from nlq.report.report import build_report, summary_lines
from nlq.report.runs import collect

CHUNK = 100


def write_test(d, doc_nats, doc_tokens, machine=None):
    """A run's test split as the trainer writes it: test_docs.json with documents and chunks
    of CHUNK tokens of the stream (each document's tokens at its mean loss), and summary.json's
    test keys and machine record."""
    nats, tokens = np.asarray(doc_nats, float), np.asarray(doc_tokens)
    per_token = np.repeat(nats / tokens, tokens)  # (sum tokens,)
    starts = np.arange(0, len(per_token), CHUNK)
    s = json.loads((d / "summary.json").read_text())
    loss = float(nats.sum() / tokens.sum())
    s |= {"test_loss": loss, "test_ppl": math.exp(loss), "test_tokens": int(tokens.sum()),
          "test_docs": len(nats), **(machine or {})}
    (d / "summary.json").write_text(json.dumps(s))
    (d / "test_docs.json").write_text(json.dumps({
        "doc": list(range(len(nats))), "nats": nats.tolist(), "tokens": tokens.tolist(),
        "chunk_size": CHUNK, "chunk_nats": np.add.reduceat(per_token, starts).tolist(),
        "chunk_tokens": np.diff([*starts, len(per_token)]).tolist()}))


PRIMARY = {"threads": 1, "isa": "AVX2", "cpu": "Test CPU"}


def experiment(root, seeds=4, gain_wide=-0.01, gain_nl=-0.02):
    """linear, linear+12.5% and nonlinear with the paper's claims (control included); each
    document's nats are linear's times (1 + gain) with a little noise per seed."""
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(200, 400, size=30)]
    for k in range(seeds):
        base = rng.uniform(3.0, 4.0, size=30) * np.array(tokens)
        for arm, gain in (("linear", 0.0), ("linear+12.5%", gain_wide), ("nonlinear", gain_nl)):
            d = make_run(root, arm, k, [9.0, 6.0, 5.0, 4.5],
                         {"model.query": "nonlinear"} if arm == "nonlinear" else None)
            write_test(d, base * (1 + gain + rng.normal(0, 0.001)), tokens, PRIMARY)
    return declare_paper(root, control=True)


def add_replicate(root, arm, seed, factor, threads=2):
    """runs/<arm>/seed<k>-threads<M>/ as reproduce writes it: the primary's files, arm.json
    with "replicate": true, and test losses times factor (another summation order)."""
    src = root / "runs" / arm / f"seed{seed}"
    d = src.with_name(f"seed{seed}-threads{threads}")
    shutil.copytree(src, d)
    info = json.loads((d / "arm.json").read_text())
    (d / "arm.json").write_text(json.dumps(info | {"replicate": True}))
    docs = json.loads((src / "test_docs.json").read_text())
    write_test(d, np.array(docs["nats"]) * factor, docs["tokens"],
               PRIMARY | {"threads": threads})
    return d


SEED_KEYS = ("arms", "positive_control", "preregistered", "preregistered_verdicts",
             "ordering", "strong_baseline", "stability", "convergence", "verdicts_allowed",
             "first_line", "split")


def test_replicates_leave_the_seed_statistics_unchanged(tmp_path):
    exp = experiment(tmp_path / "exp")
    without = build_report([exp], tmp_path / "a")
    assert not without["numerical_noise"]["measured"]
    md = (tmp_path / "a" / "report.md").read_text()
    assert "Rounding noise was not measured" in md and "--replicates K" in md
    for arm in ("linear", "nonlinear", "linear+12.5%"):
        add_replicate(exp, arm, 0, 1.0005)
    with_reps = build_report([exp], tmp_path / "b")
    for k in SEED_KEYS:
        assert with_reps[k] == without[k], k
    assert with_reps["measured"]["n_finished_runs"] == 12
    assert with_reps["measured"]["n_replicates"] == 3
    assert with_reps["numerical_noise"]["measured"]


def test_noise_numbers_recomputed_by_hand(tmp_path):
    exp = experiment(tmp_path / "exp")
    factors = {("linear", 0): 1.002, ("nonlinear", 0): 0.999, ("linear", 1): 0.9995,
               ("nonlinear", 1): 1.001, ("linear+12.5%", 0): 1.0}
    for (arm, seed), f in factors.items():
        add_replicate(exp, arm, seed, f)
    rep = build_report([exp], tmp_path / "out")
    n = rep["numerical_noise"]

    def loss(arm, name):
        return json.loads((exp / "runs" / arm / name / "summary.json").read_text())["test_loss"]

    diffs = {(x["arm"], x["seed"]): x["diff_pct"] for x in n["replicates"]}
    for arm, seed in factors:
        p, r = loss(arm, f"seed{seed}"), loss(arm, f"seed{seed}-threads2")
        assert diffs[(arm, seed)] == pytest.approx(100 * (r - p) / p)
    xs = list(diffs.values())
    assert n["run_diff_pct"]["rms"] == pytest.approx(math.sqrt(np.mean(np.square(xs))))
    assert n["run_diff_pct"]["sd"] == pytest.approx(np.std(xs, ddof=1))
    assert n["identical"] == 1  # linear+12.5% seed 0 at factor 1.0

    [nl_lin] = [c for c in n["comparisons"] if (c["arm"], c["against"]) == ("nonlinear", "linear")]
    changes = []
    for seed in (0, 1):
        before = 100 * (loss("nonlinear", f"seed{seed}") / loss("linear", f"seed{seed}") - 1)
        after = 100 * (loss("nonlinear", f"seed{seed}-threads2")
                       / loss("linear", f"seed{seed}-threads2") - 1)
        changes.append(after - before)
    assert [x["change_pct"] for x in nl_lin["per_seed"]] == pytest.approx(changes)
    rms = math.sqrt(np.mean(np.square(changes)))
    sd = rep["preregistered"][0]["sd_pct"]
    assert nl_lin["seed_sd_pct"] == sd
    assert nl_lin["share"] == pytest.approx(rms ** 2 / 2 / sd ** 2)
    # rounding changes of ~0.3% against a seed-to-seed sd of ~0.1%: a large share, said so
    assert n["large"] and n["share_answer"].startswith("Rounding noise is a large part")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Numerical noise" in md and "| 5 | replicate | 2 | AVX2 | Test CPU |" in md
    assert "Rounding noise is a large part of what the intervals measure" in md


def test_a_verdict_that_a_replicate_flips_is_no_finding(tmp_path):
    """nonlinear beats linear by 2% (and linear+12.5% by 1%) on every seed; the replicates of
    seeds 0 and 1 put nonlinear level with linear (and 1% above linear+12.5%), so with them
    both intervals span 0."""
    exp = experiment(tmp_path / "exp")
    assert build_report([exp], tmp_path / "before")["preregistered_verdicts"][0].startswith(
        "nonlinear beats linear")
    for seed in (0, 1):
        add_replicate(exp, "linear", seed, 1.0)
        add_replicate(exp, "nonlinear", seed, 1 / 0.98)
    rep = build_report([exp], tmp_path / "out")
    [swap] = rep["numerical_noise"]["swapped"]
    assert swap["seeds"] == [0, 1] and not swap["control_changed"]
    assert swap["changed"] == ["nonlinear vs linear", "nonlinear vs linear+12.5%"]
    assert rep["numerical_noise"]["unstable"] == swap["changed"]
    md = (tmp_path / "out" / "report.md").read_text().splitlines()
    assert md[2].startswith("**The verdict does not survive a change of summation order: "
                            "nonlinear vs linear: beats with the primary runs, no detectable "
                            "difference with seed(s) 0, 1 replaced")
    v = rep["preregistered_verdicts"][0]
    assert v.startswith("nonlinear vs linear: no finding: the verdict (beats with the primary "
                        "runs) does not survive a change of summation order")
    text = "\n".join(md + summary_lines(rep))
    assert "nonlinear beats" not in text and "holds here" not in text
    assert summary_lines(rep)[0] == rep["rounding_line"]
    # the control did not move: it passed, and says so on the next line
    assert md[4].startswith("**Positive control passed")


def test_a_control_that_a_replicate_flips_gives_no_verdict(tmp_path):
    exp = experiment(tmp_path / "exp")
    for seed in (0, 1):
        add_replicate(exp, "linear", seed, 1.0)
        add_replicate(exp, "linear+12.5%", seed, 1 / 0.99)
    rep = build_report([exp], tmp_path / "out")
    assert rep["numerical_noise"]["control_unstable"] and not rep["verdicts_allowed"]
    assert rep["preregistered_verdicts"] == []
    assert rep["rounding_line"].startswith("The positive control does not survive a change "
                                           "of summation order, so no verdict is given")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Verdicts" not in md and "does not survive a change of summation order" in md


def test_two_replicates_of_one_run_at_one_thread_count_are_an_error(tmp_path):
    exp = experiment(tmp_path / "exp", seeds=2)
    add_replicate(exp, "linear", 0, 1.001)
    d = add_replicate(exp, "linear", 0, 1.002, threads=4)
    assert len(collect([exp])) == 8  # two thread counts: two replicates
    shutil.copytree(d, d.with_name("copy"))
    with pytest.raises(NlqError, match="two finished replicates with seed 0 .threads 4."):
        collect([exp])


def test_old_runs_record_no_machine(tmp_path):
    make_run(tmp_path, "linear", 0, [9, 6, 5, 4.5])
    make_run(tmp_path, "linear", 1, [9, 6, 5, 4.6])
    rep = build_report([tmp_path / "runs"], tmp_path / "out")
    assert rep["numerical_noise"]["machines"] == ["not recorded"]
    assert "| 2 | primary | not recorded | not recorded | not recorded |" in (
        tmp_path / "out" / "report.md").read_text()


def test_the_bootstrap_resamples_chunks_where_runs_have_them(tmp_path):
    exp = experiment(tmp_path / "exp", seeds=3)
    rep = build_report([exp], tmp_path / "out")
    b = rep["preregistered"][0]["bootstrap"]
    tokens = json.loads((exp / "runs" / "linear" / "seed0" / "test_docs.json").read_text())
    assert b["unit"] == f"chunks of {CHUNK} scored tokens"
    assert b["n_units"] == len(tokens["chunk_tokens"]) == math.ceil(sum(tokens["tokens"]) / CHUNK)
    assert f"chunks of {CHUNK} scored tokens ({b['n_units']:,} of them)" in (
        tmp_path / "out" / "report.md").read_text()
    # one run without chunks (an old run): documents for that comparison
    d = exp / "runs" / "linear" / "seed1" / "test_docs.json"
    docs = json.loads(d.read_text())
    d.write_text(json.dumps({k: docs[k] for k in ("doc", "nats", "tokens")}))
    b = build_report([exp], tmp_path / "old")["preregistered"][0]["bootstrap"]
    assert b["unit"] == "documents" and b["n_units"] == 30


def test_batched_bootstrap_equals_a_plain_loop():
    """The bootstrap weighs replicates in batches; a plain loop over the same draws (one
    (R, n) pick, then one multinomial row per replicate, shared by its seeds) gives the same
    interval."""
    rng = np.random.default_rng(4)
    n, D, R = 3, 40, 250
    tok = rng.integers(50, 150, size=(n, D)).astype(float)
    base = rng.uniform(3, 4, size=(n, D)) * tok
    arm = base * (1 + rng.normal(-0.01, 0.02, size=(n, D)))
    got = paired_bootstrap(arm, base, tok, reps=R, seed=7)
    draw = np.random.default_rng(7)
    pick = draw.integers(0, n, size=(R, n))
    stat = []
    for r in range(R):
        per_seed = []
        w = draw.multinomial(D, np.full(D, 1.0 / D))  # the test units of this replicate
        for j in range(n):
            s = pick[r, j]
            la, lb = (w @ arm[s]) / (w @ tok[s]), (w @ base[s]) / (w @ tok[s])
            per_seed.append(100 * (la - lb) / lb)
        stat.append(np.mean(per_seed))
    lo, hi = np.quantile(stat, [0.025, 0.975])
    assert (got["lo"], got["hi"]) == (pytest.approx(lo, rel=1e-12), pytest.approx(hi, rel=1e-12))


def test_attention_logit_ranges_recomputed_by_hand(tmp_path):
    """The report's attention-logit table: per arm the mean and max over seeds of each run's
    largest |logit| over layers, the sd mean over layers and runs; runs without the record
    (older ones) are left out, an arm with none has no row."""
    exp = experiment(tmp_path / "exp", seeds=3)
    recs = {}
    for summ in sorted(exp.glob("runs/*/seed*/summary.json")):
        arm, k = summ.parent.parent.name, int(summ.parent.name[len("seed"):])
        if arm == "linear+12.5%" or (arm == "linear" and k == 2):
            continue
        rec = {"rows": 4, "max_abs": [2.0 + k, 5.0 * (arm == "nonlinear") + k],
               "sd": [0.5, 1.0 + k]}
        recs.setdefault(arm, []).append(rec)
        s = json.loads(summ.read_text())
        summ.write_text(json.dumps(s | {"attn_logits": rec}))
    rep = build_report([exp], tmp_path / "r")
    rows = {r["arm"]: r for r in rep["attention_logits"]}
    assert set(rows) == {"linear", "nonlinear"}
    for arm, rs in recs.items():
        tops = [max(r["max_abs"]) for r in rs]
        assert rows[arm]["n_seeds"] == len(rs)
        assert rows[arm]["max_abs_mean"] == pytest.approx(np.mean(tops))
        assert rows[arm]["max_abs_max"] == max(tops)
        assert rows[arm]["sd_mean"] == pytest.approx(np.mean([v for r in rs for v in r["sd"]]))
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Attention logits at the end of training" in md
    assert f"| nonlinear | 3 | {rows['nonlinear']['max_abs_mean']:.2f} |" in md


def test_replicates_are_listed_seed_by_seed_whatever_the_order_of_the_run_dirs(tmp_path):
    """`nlq reproduce` hands the report its runs seed by seed, `nlq report DIR` finds them arm
    by arm: the same replicates, in the same order (seed, then the report's arm order)."""
    exp = experiment(tmp_path / "exp")
    for seed in (0, 1):
        for arm in ("linear", "nonlinear"):
            add_replicate(exp, arm, seed, 1.001)
    dirs = sorted(p for p in (exp / "runs").glob("*/*") if p.is_dir())  # arm by arm
    by_seed = sorted(dirs, key=lambda p: (p.name.split("-")[0], p.parent.name))
    a = build_report(dirs, tmp_path / "a")["numerical_noise"]["replicates"]
    b = build_report(by_seed, tmp_path / "b")["numerical_noise"]["replicates"]
    assert [(x["arm"], x["seed"]) for x in a] == [(x["arm"], x["seed"]) for x in b]
    assert [x["seed"] for x in a] == [0, 0, 1, 1]


def _machine_experiment(root, gains):
    """linear, linear+12.5% and nonlinear (the paper's claims, control included), seed k on
    machine "A" or "B" as gains[k] = (machine, nonlinear's gain) says; linear+12.5% 1% below
    linear everywhere."""
    rng = np.random.default_rng(1)
    tokens = [int(t) for t in rng.integers(200, 400, size=30)]
    for k, (machine, gain_nl) in enumerate(gains):
        rec = {"threads": 1, "isa": "AVX2" if machine == "A" else "AVX512", "cpu": machine}
        base = rng.uniform(3.0, 4.0, size=30) * np.array(tokens)
        for arm, gain in (("linear", 0.0), ("linear+12.5%", -0.01), ("nonlinear", gain_nl)):
            d = make_run(root, arm, k, [9.0, 6.0, 5.0, 4.5],
                         {"model.query": "nonlinear"} if arm == "nonlinear" else None)
            write_test(d, base * (1 + gain + rng.normal(0, 0.001)), tokens, rec)
    return declare_paper(root, control=True)


def test_each_machines_runs_alone_are_a_report_of_those_runs(tmp_path):
    """The report's per-machine rows equal what a report of only that machine's runs finds."""
    exp = _machine_experiment(tmp_path / "exp", [("A", -0.02)] * 4 + [("B", -0.015)] * 4)
    rep = build_report([exp], tmp_path / "all")
    groups = rep["numerical_noise"]["by_machine"]
    assert [(g["cpu"], g["n_runs"]) for g in groups] == [("A", 12), ("B", 12)]
    for g, seeds in zip(groups, (range(4), range(4, 8)), strict=True):
        dirs = [exp / "runs" / a / f"seed{k}" for a in ("linear", "linear+12.5%", "nonlinear")
                for k in seeds]
        alone = build_report(dirs, tmp_path / g["cpu"], claims=find_claims([exp], dirs))
        want = [alone["positive_control"], *alone["preregistered"]]
        assert alone["numerical_noise"]["by_machine"] == []  # one machine: no such section
        for row, c in zip(g["comparisons"], want, strict=True):
            assert (row["arm"], row["against"], row["n_seeds"]) == (c["arm"], c["against"], 4)
            assert row["mean_pct"] == pytest.approx(c["mean_pct"])
            assert row["ci95"] == pytest.approx(c["ci95"])
            if row["role"] == "pre-registered":
                assert row["p_holm"] == pytest.approx(c["p_holm"])
                assert row["outcome"] == outcome(c) and not row["reversed"]
            else:
                assert row["outcome"] == "passes"
    md = (tmp_path / "all" / "report.md").read_text()
    assert "| comparison | role | A, AVX2, 1 thread(s) (12 runs) | B, AVX512, 1 thread(s) (12 runs) |" in md
    assert "no verdict reverses on any machine." in md


def test_a_verdict_that_reverses_on_one_machine_is_said(tmp_path):
    """nonlinear 3% below linear on machine A's six seeds, 0.5% above on B's three: the whole
    says it beats linear; B's runs alone say it is worse, and the report says so."""
    exp = _machine_experiment(tmp_path / "exp", [("A", -0.03)] * 6 + [("B", 0.005)] * 3)
    rep = build_report([exp], tmp_path / "out")
    whole = {(c["arm"], c["against"]): c for c in rep["preregistered"]}
    assert rep["verdicts_allowed"]
    assert outcome(whole[("nonlinear", "linear")]) == "beats"
    b = rep["numerical_noise"]["by_machine"][1]
    row = next(x for x in b["comparisons"] if (x["arm"], x["against"]) == ("nonlinear", "linear"))
    assert (row["outcome"], row["whole"], row["reversed"], row["n_seeds"]) == (
        "worse", "beats", True, 3)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**reverses** for nonlinear vs linear on B, AVX512, 1 thread(s)" in md
    assert any("**reverses**" in line for line in summary_lines(rep))
