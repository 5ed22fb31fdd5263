"""`nlq study` bookkeeping on a toy ladder: 2 rungs x 2 arms, a few steps per run."""

from __future__ import annotations

import json
import math

import pytest
from helpers import nlq, ok
from test_reproduce import SETS, mini_setting

from nlq.experiments.ladder import load_ladder
from nlq.experiments.study import widen
from nlq.experiments.sweep import check_grid


def toy_ladder(tmp_path, d_model_b: int = 48, stack: int = 1) -> tuple:
    exp, _ = mini_setting(tmp_path)  # the mini experiment and its data
    sets = dict(s.split("=", 1) for s in SETS + [f'data.dir="{tmp_path / "data"}"'])
    def table(extra):
        return "{ " + ", ".join(f'"{k}" = {v}' for k, v in {**sets, **extra}.items()) + " }"
    ladder = tmp_path / "ladder.toml"
    ladder.write_text(f"""
experiment = "{exp}"
arms = ["linear", "nonlinear"]
[rungs.A]
preset = "tiny"
set = {table({})}
lrs = [1e-3, 2e-3, 4e-3]
sweep_seeds = 2
seeds = 2
stack = {stack}
[rungs.B]
preset = "tiny"
set = {table({"model.d_model": d_model_b})}
lrs = [1e-3, 2e-3, 4e-3]
sweep_seeds = 2
seeds = 2
""")
    return ladder


def study(ladder, out, *args, **env):
    return nlq("study", "--ladder", ladder, "--out", out, "--jobs", "2", *args, timeout=1200,
               **env)


def test_widen_grows_the_grid_toward_an_edge_best_within_limits():
    g = [1e-3, 2e-3, 4e-3]
    assert widen(g, {"a": {"grid_best": 2e-3}}, g) == g
    assert widen(g, {"a": {"grid_best": 4e-3}, "b": {"grid_best": 2e-3}}, g) == [
        1e-3, 2e-3, 4e-3, 8e-3]
    assert widen(g, {"a": {"grid_best": 1e-3}}, g) == [5e-4, 1e-3, 2e-3, 4e-3]
    grown = [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]  # two steps beyond the declared top: no more
    assert widen(grown, {"a": {"grid_best": 1.6e-2}}, g) == grown


def test_widen_of_a_sqrt2_grid_steps_by_sqrt2_to_the_same_factor():
    """A x sqrt(2) grid grows one sqrt(2) step at a time, to the same factor beyond the
    declared grid as a x2 grid (x4), in twice as many steps."""
    r = math.sqrt(2.0)
    g = [1e-2, 1e-2 * r, 2e-2]
    lrs, x2 = g, [1e-2, 2e-2, 4e-2]
    for _ in range(10):  # the lowest point stays at the low edge: grow until the limit
        lrs = widen(lrs, {"a": {"grid_best": lrs[0]}}, g)
        x2 = widen(x2, {"a": {"grid_best": x2[0]}}, [1e-2, 2e-2, 4e-2])
        check_grid(lrs)  # still one constant step
    assert len(lrs) == len(g) + 4 and len(x2) == 3 + 2
    assert lrs[0] == pytest.approx(x2[0], rel=1e-12) == 2.5e-3


def test_plan_counts_a_grown_grid_and_each_phase_finished_runs(tmp_path):
    """The plan's run count follows the sweep's grid once it has grown past the ladder's, and
    each phase's finished runs count against that phase only (a grown sweep's surplus must
    not hide unfinished evaluation seeds)."""
    from nlq.experiments.study import rung_cost

    ladder = load_ladder(toy_ladder(tmp_path))
    out, rung = tmp_path / "study", ladder.rungs["A"]
    assert rung_cost(ladder, rung, out)["runs"] == 2 * (3 * 2 + 2)  # arms x (grid x seeds + seeds)
    sweep = out / "A" / "sweep"
    sweep.mkdir(parents=True)
    (sweep / "sweep-plan.json").write_text(json.dumps({"grid": [5e-4, 1e-3, 2e-3, 4e-3, 8e-3]}))
    for i in range(2 * 5 * 2):  # every sweep run of the grown grid finished
        (sweep / "runs" / f"r{i}").mkdir(parents=True)
        (sweep / "runs" / f"r{i}" / "summary.json").write_text("{}")
    (out / "A" / "compare" / "runs" / "s0").mkdir(parents=True)
    (out / "A" / "compare" / "runs" / "s0" / "summary.json").write_text("{}")
    c = rung_cost(ladder, rung, out)
    assert (c["runs"], c["done"]) == (2 * (5 * 2 + 2), 2 * 5 * 2 + 1)
    assert c["processes"] == c["runs"]  # every run alone
    stacked = load_ladder(toy_ladder(tmp_path, stack=2)).rungs["A"]
    assert rung_cost(ladder, stacked, out)["processes"] == 2 * (5 + 1)  # 2 seeds a process


def test_ladder_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[rungs.A]\npreset = "tiny"\nlrs = [1e-3, 2e-3, 4e-3]\nsteps = 3\n')
    p = nlq("study", "--ladder", bad, "--out", tmp_path / "o", "--dry-run")
    assert p.returncode == 2 and "unknown key 'steps'" in p.stderr
    assert not (tmp_path / "o").exists()
    ladder = toy_ladder(tmp_path)
    p = nlq("study", "--ladder", ladder, "--rungs", "Z", "--out", tmp_path / "o", "--dry-run")
    assert p.returncode == 2 and "unknown rung 'Z'" in p.stderr
    assert load_ladder(ladder).rungs["B"].sets["model.d_model"] == 48


def test_a_gpu_rung_without_a_gpu_is_one_error_unless_forced(tmp_path):
    """R1 needs CUDA: on a machine without it, one error before anything is written (its
    --dry-run still prints the plan)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the rung would run")
    p = nlq("study", "--rungs", "R1", "--out", tmp_path / "o", "--jobs", "auto")
    assert p.returncode == 2, p.stderr
    assert "rung R1 needs a CUDA GPU and none is visible here" in p.stderr
    assert "--force" in p.stderr and p.stderr.count("nlq: error") == 1
    assert not (tmp_path / "o").exists()
    p = nlq("study", "--rungs", "R1", "--out", tmp_path / "o", "--dry-run")
    assert p.returncode == 0 and "R1" in p.stdout


def test_changed_rung_on_resume_is_refused_before_any_training(tmp_path):
    ladder = toy_ladder(tmp_path)
    out = tmp_path / "study"
    from nlq.experiments.study import check_rung, rung_record

    lad = load_ladder(ladder)
    check_rung(out / "B", rung_record(lad, lad.rungs["B"]))  # as a started study leaves it
    changed = toy_ladder(tmp_path, d_model_b=64)
    p = study(changed, out)
    assert p.returncode == 2
    assert "rung 'B' was started with set" in p.stderr and "new rung" in p.stderr
    assert not (out / "A").exists()  # refused before rung A trained anything


def test_seeds_may_be_redeclared_only_before_any_evaluation_run_finished(tmp_path):
    """A rung's evaluation size (seeds) may change while no evaluation run has finished (no
    result seen: e.g. set by another rung's power analysis); once one has, a change is a new
    design and is refused, as is seeds changed together with anything else."""
    from nlq.errors import NlqError
    from nlq.experiments.study import check_rung, rung_record

    ladder = toy_ladder(tmp_path)
    lad = load_ladder(ladder)
    out = tmp_path / "study" / "A"
    rec = rung_record(lad, lad.rungs["A"])
    check_rung(out, rec)
    more_seeds = tmp_path / "more.toml"  # rung A with 3 seeds: `nlq study --dry-run` writes nothing
    more_seeds.write_text(ladder.read_text().replace("\nseeds = 2\n", "\nseeds = 3\n", 1))
    p = nlq("study", "--ladder", more_seeds, "--rungs", "A", "--out", out.parent, "--dry-run")
    assert p.returncode == 0 and "seeds 2 -> 3" in p.stderr and "would be" in p.stderr
    assert json.loads((out / "rung.json").read_text())["seeds"] == 2
    (out / "sweep" / "runs" / "r").mkdir(parents=True)  # a finished sweep run changes nothing
    (out / "sweep" / "runs" / "r" / "summary.json").write_text("{}")
    more = {**rec, "seeds": 16}
    check_rung(out, more, write=False)  # --dry-run: checked, nothing written
    assert json.loads((out / "rung.json").read_text())["seeds"] == rec["seeds"]
    check_rung(out, more)
    assert json.loads((out / "rung.json").read_text())["seeds"] == 16
    with pytest.raises(NlqError, match="was started with lrs"):
        check_rung(out, {**more, "seeds": 20, "lrs": [1.0, 2.0, 4.0]})
    (out / "compare" / "runs" / "s0").mkdir(parents=True)
    (out / "compare" / "runs" / "s0" / "summary.json").write_text("{}")
    with pytest.raises(NlqError, match="seeds are fixed once an evaluation run has finished"):
        check_rung(out, {**more, "seeds": 20})
    check_rung(out, more)  # unchanged: resumes
    assert json.loads((out / "rung.json").read_text())["seeds"] == 16


@pytest.mark.slow
def test_killed_study_resumes_to_the_same_report(tmp_path):
    ladder = toy_ladder(tmp_path)
    whole = tmp_path / "whole"
    ok(study(ladder, whole))
    killed = tmp_path / "killed"
    p = study(ladder, killed, NLQ_FAULT="step@4")  # every run is SIGKILLed after step 4
    assert p.returncode == 1 and not any(killed.rglob("summary.json"))
    ok(study(ladder, killed))

    def numbers(d):  # the seconds a run took differ; every number it computed may not
        rep = json.loads((d / "study.json").read_text())
        assert rep.pop("machine")["cpu_count"] >= 1  # commit and dirtiness: when it ran
        for r in rep["rungs"]:
            assert r["cost"]["runs"] >= 2 * (3 * 2 + 2)  # more where a grid grew
            r["cost"].pop("run_seconds")
        return rep

    a = numbers(whole)
    assert a == numbers(killed)
    assert [r["status"] for r in a["rungs"]] == ["done", "done"]
    # the second rung is the wider model: more non-embedding parameters on the x axis
    assert a["rungs"][1]["params_non_embedding"] > a["rungs"][0]["params_non_embedding"]
    assert (whole / "scale.png").read_bytes()[:4] == b"\x89PNG"
    def seconds(d):
        return [r["cost"]["run_seconds"] for r in json.loads((d / "study.json").read_text())["rungs"]]

    before = seconds(whole)
    ok(study(ladder, whole))  # a third run trains nothing and writes the same report
    assert numbers(whole) == a and seconds(whole) == before
    # the committable copy: every rung's sweep and comparison, no checkpoint
    ok(nlq("export", whole, tmp_path / "results"))
    res = tmp_path / "results"
    assert numbers(res) == a
    assert (res / "B" / "rung.json").is_file() and (res / "B" / "compare" / "report.md").is_file()
    assert len(list(res.rglob("summary.json"))) == len(list(whole.rglob("summary.json")))
    assert not list(res.rglob("ckpt"))


@pytest.mark.slow
def test_sigterm_mid_sweep_stops_exports_and_resumes_to_the_same_study(tmp_path):
    """SIGTERM to `nlq study` while its first sweep trains 2 runs: every child stops (none
    left), the study exits 143 having written its report of what finished (so `nlq export`
    works on it), and the same command then ends with the study.json of an uninterrupted
    study."""
    import os
    import signal
    import subprocess
    import time

    from helpers import children_of, last_step, nlq_cmd

    ladder = toy_ladder(tmp_path)
    whole = tmp_path / "whole"
    ok(study(ladder, whole))
    out = tmp_path / "stopped"
    p = subprocess.Popen(nlq_cmd("study", "--ladder", ladder, "--out", out, "--jobs", "2"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    deadline = time.time() + 600
    while True:  # two sweep runs under way, past their first checkpoint
        runs = list((out / "A" / "sweep" / "runs").glob("*/*/*")) if out.exists() else []
        if sum(last_step(r) >= 3 for r in runs) >= 1 and len(children_of(out)) == 2:
            break
        assert p.poll() is None and time.time() < deadline, "the sweep never got going"
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "stopped by signal 15" in err and "Traceback" not in err
    assert children_of(out) == []
    assert (out / "study.json").is_file()
    ok(nlq("export", out, tmp_path / "partial"))  # what finished is exportable
    ok(study(ladder, out))

    def numbers(d):
        rep = json.loads((d / "study.json").read_text())
        rep.pop("machine")
        for r in rep["rungs"]:
            r["cost"].pop("run_seconds")
        return rep

    assert numbers(out) == numbers(whole)


@pytest.mark.slow
def test_a_study_killed_mid_phase_has_exported_every_finished_run(tmp_path):
    """--export DIR: a study SIGKILLed (no handler runs: a time limit's kill) while its first
    rung's seeds train has in DIR, without checkpoints, its finished sweep and every seed run
    that finished before the kill (each exported as it finished, not at the phase's end);
    the rerun completes DIR to what `nlq export` of the whole study gives."""
    import time

    from helpers import kill_group, nlq_cmd, popen_group

    ladder = toy_ladder(tmp_path)
    out, exp = tmp_path / "out", tmp_path / "exported"
    p = popen_group(nlq_cmd("study", "--ladder", ladder, "--out", out, "--jobs", "2",
                            "--export", exp), OMP_NUM_THREADS="1")
    deadline = time.time() + 600
    while not list((exp / "A" / "compare" / "runs").rglob("summary.json")):  # a seed run
        assert p.poll() is None and time.time() < deadline, p.communicate()[1][-2000:]
        time.sleep(0.05)
    killed_at = time.time()
    kill_group(p)
    p.wait()
    finished = {r.parent.relative_to(out) for r in out.rglob("summary.json")}
    got = {r.parent.relative_to(exp) for r in exp.rglob("summary.json")}
    assert got <= finished
    # missing: at most a run that finished in the moment before the kill (the runner looks
    # at its children twice a second)
    missing = finished - got
    assert all((out / r / "summary.json").stat().st_mtime > killed_at - 5 for r in missing)
    assert len([r for r in got if r.parts[1] == "sweep"]) >= 2 * 3 * 2  # arms x lrs x seeds
    assert (exp / "A" / "sweep" / "sweep.json").is_file() and not list(exp.rglob("ckpt*"))
    assert (exp / "A" / "rung.json").is_file() and (exp / "A" / "compare" / "experiment.toml"
                                                    ).is_file()
    ok(study(ladder, out, "--export", exp))
    ok(nlq("export", out, tmp_path / "whole"))
    names = sorted(str(f.relative_to(tmp_path / "whole"))
                   for f in (tmp_path / "whole").rglob("*") if f.is_file())
    assert names == sorted(str(f.relative_to(exp)) for f in exp.rglob("*") if f.is_file())
    assert len(list(exp.rglob("summary.json"))) == len(list(out.rglob("summary.json")))


def test_export_run_copies_one_finished_run_as_nlq_export_does(tmp_path):
    """export_run: one finished run of a study into DEST where `nlq export` puts it (the same
    bytes), with the plan files of the folders above it; an unfinished run: nothing."""
    from nlq.report.export import export_results, export_run

    src = tmp_path / "study"
    sweep = src / "S9" / "sweep"
    sweep.mkdir(parents=True)
    (src / "study.json").write_text("{}")
    (src / "S9" / "rung.json").write_text('{"name": "S9"}')
    (sweep / "sweep-plan.json").write_text('{"grid": [1]}')
    runs = [sweep / "runs" / "lr0.001" / "linear" / f"seed{i}" for i in (1000, 1001)]
    for i, run in enumerate(runs):
        run.mkdir(parents=True)
        (run / "config.toml").write_text("x = 1\n")
        (run / "ckpt-000010.pt").write_bytes(b"weights")
        (run / "metrics.jsonl").write_text('{"kind": "meta"}\n{"kind": "train", "step": 1}\n'
                                           '{"kind": "eval", "step": 2}\n{"torn')
        if i == 0:
            (run / "summary.json").write_text('{"val_loss": 3.0}')
    dest = tmp_path / "dest"
    assert export_run(src, runs[1], dest) == []  # no summary: not finished
    assert not dest.exists()
    written = export_run(src, runs[0], dest)
    files = sorted(str(f.relative_to(dest)) for f in dest.rglob("*") if f.is_file())
    assert files == sorted(str(f.relative_to(dest)) for f in written) == [
        "S9/rung.json", "S9/sweep/runs/lr0.001/linear/seed1000/config.toml",
        "S9/sweep/runs/lr0.001/linear/seed1000/metrics.jsonl",
        "S9/sweep/runs/lr0.001/linear/seed1000/summary.json", "S9/sweep/sweep-plan.json"]
    whole = tmp_path / "whole"
    export_results(src, whole)
    for f in files:
        assert (dest / f).read_bytes() == (whole / f).read_bytes(), f


def test_study_md_gives_each_preregistered_pair_with_or_without_a_verdict(tmp_path):
    """From a rung's report.json (the committed S0 one: its positive control failed), the
    study report lists every pre-registered pair with its numbers, marked as no verdict; the
    same report with verdicts allowed lists the verdicts instead."""
    import shutil
    from pathlib import Path

    from nlq.experiments.study_report import build_study_report

    src = Path(__file__).parents[1] / "results" / "study" / "S0" / "compare" / "report.json"
    rep = json.loads(src.read_text())
    (tmp_path / "S0" / "compare").mkdir(parents=True)
    shutil.copy(src, tmp_path / "S0" / "compare" / "report.json")
    build_study_report(load_ladder(), tmp_path)
    md = (tmp_path / "study.md").read_text()
    assert not rep["verdicts_allowed"] and "**failed: cannot test the claim**" in md
    for c in rep["preregistered"]:
        lo, hi = c["ci95"]
        assert (f"  - {c['arm']} vs {c['against']} (pre-registered; described, no verdict): "
                f"{c['mean_pct']:+.2f}% [{lo:+.2f}, {hi:+.2f}], {c['n_seeds']} seeds") in md
    rep.update(verdicts_allowed=True, preregistered_verdicts=["a verdict", "another"])
    (tmp_path / "S0" / "compare" / "report.json").write_text(json.dumps(rep))
    md = build_study_report(load_ladder(), tmp_path) and (tmp_path / "study.md").read_text()
    assert "  - a verdict\n  - another\n" in md and "described, no verdict" not in md
    assert "| S0 |" in md and "| passed |" in md


@pytest.mark.slow
@pytest.mark.parametrize("limit_s, stack", [(20, 1), (900, 1), (20, 2)])
def test_gpu_study_script_packs_every_finished_run_when_stopped_or_done(tmp_path, limit_s,
                                                                         stack):
    """scripts/gpu_study.sh (a GPU loan's share of the study) on a toy CPU ladder: stopped by
    its time limit mid-study, or left to finish, it exits 0 and its study.tgz holds exactly the
    runs the working study finished; a second loan continues the same working study. With
    stack = 2 (as the GPU rungs stack their seeds) the stacks stop and continue alike."""
    import subprocess
    import tarfile

    from helpers import PY, ROOT, env

    ladder, study_dir, loan = (toy_ladder(tmp_path, stack=stack), tmp_path / "study",
                               tmp_path / "loan")
    e = env(OUT=loan, NLQ_GPU_S=limit_s, NLQ_JOBS=2, NLQ_STUDY=study_dir, PYTHON=PY,
            NLQ_FROM=tmp_path / "no-committed-study", NLQ_STUDY_ARGS=f"--ladder {ladder}")
    p = subprocess.run(["bash", "scripts/gpu_study.sh", "A"], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=1500, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    stopped = "rc 124" in p.stdout
    assert stopped == (limit_s == 20), p.stdout
    log = (loan / "study.log").read_text()
    assert ("stopped by signal 15" in log) == stopped
    with tarfile.open(loan / "study.tgz") as tar:
        packed = {n.removeprefix("study/") for n in tar.getnames() if n.endswith("summary.json")}
        assert not [n for n in tar.getnames() if "checkpoint" in n]
    finished = {str(s.relative_to(study_dir)) for s in study_dir.rglob("summary.json")}
    assert packed == finished and finished
    assert not (loan / "study").exists()  # packed, not left beside the archive
    if stopped:  # the next loan continues the same study to its end
        e["NLQ_GPU_S"] = "900"
        p = subprocess.run(["bash", "scripts/gpu_study.sh", "A"], cwd=ROOT, env=e,
                           capture_output=True, text=True, timeout=1500, check=False)
        assert p.returncode == 0 and "rc 0" in p.stdout, p.stdout + p.stderr
        assert (study_dir / "A" / "compare" / "report.json").is_file()
        summaries = [json.loads(f.read_text()) for f in study_dir.rglob("summary.json")]
        assert {s.get("stack", 1) for s in summaries} == {stack}


def test_study_md_hides_a_rung_changed_since_its_runs_and_flags_edges_and_no_control(tmp_path):
    """The committed S1 rung under a ladder whose S1 is now d=96: its d=64 numbers are not
    shown as the new rung's; a rung whose sweep ended at a grid edge says so; an experiment
    without a positive control reads "none declared", not "passed"."""
    import shutil
    from pathlib import Path

    from nlq.experiments.study_report import build_study_report

    committed = Path(__file__).parents[1] / "results" / "study"
    for r in ("S1", "S2"):
        (tmp_path / r / "compare").mkdir(parents=True)
        shutil.copy(committed / r / "rung.json", tmp_path / r / "rung.json")
        shutil.copy(committed / r / "compare" / "report.json", tmp_path / r / "compare")
    text = (Path(__file__).parents[1] / "nlq" / "experiments" / "ladder.toml").read_text()
    old = 'set = { "model.d_model" = 64, "model.n_head" = 4, "model.mlp_hidden" = 256 }'
    assert text.count(old) == 1
    (tmp_path / "ladder.toml").write_text(text.replace(old, old.replace("64", "96")))
    rep = json.loads((tmp_path / "S2" / "compare" / "report.json").read_text())
    rep["lrs"]["edge"] = ["nonlinear"]
    rep.update(positive_control=None, first_line=None)
    (tmp_path / "S2" / "compare" / "report.json").write_text(json.dumps(rep))
    study_rep = build_study_report(load_ladder(tmp_path / "ladder.toml"), tmp_path)
    md = (tmp_path / "study.md").read_text()
    [s1] = [line for line in md.splitlines() if line.startswith("| S1 |")]
    assert "**changed since its runs** (sets): not shown" in s1 and "197,184" not in s1
    assert "Changed in the ladder since their runs: S1" in md
    assert [r["status"] for r in study_rep["rungs"][2:4]] == ["changed", "done"]
    [s2] = [line for line in md.splitlines() if line.startswith("| S2 |")]
    assert "| none declared |" in s2 and "| passed |" not in s2
    assert "- **S2**: No positive control declared." in md and "None" not in md
    assert "lr at the edge of the sweep's grid for nonlinear" in md
    assert f"  - {rep['preregistered_verdicts'][0]}" in md  # verdicts need no control


def test_reproduce_refuses_claims_changed_over_finished_runs(tmp_path):
    from nlq.errors import NlqError
    from nlq.experiments.experiment import experiment_toml, load_experiment
    from nlq.experiments.reproduce import check_claims

    paper = load_experiment("paper")
    (tmp_path / "experiment.toml").write_text(experiment_toml(paper))
    check_claims(tmp_path, load_experiment("strong-baseline"))  # no finished run yet: free
    (tmp_path / "runs" / "linear" / "seed0").mkdir(parents=True)
    (tmp_path / "runs" / "linear" / "seed0" / "summary.json").write_text("{}")
    check_claims(tmp_path, paper)  # the same claims: fine
    with pytest.raises(NlqError, match="hypothesis.comparisons .* claims are fixed before"):
        check_claims(tmp_path, load_experiment("strong-baseline"))


def test_scale_figure_joins_only_rungs_of_one_token_budget():
    """S0 and S0-short are one model at two budgets: the scale figure joins the rungs of the
    budget most share (S0-short, S1, S2 at 20.8 tokens per parameter), S0 a point apart."""
    from pathlib import Path

    from nlq.experiments.study_report import budget, token_budgets

    rows = json.loads((Path(__file__).parents[1] / "results" / "study" / "study.json")
                      .read_text())["rungs"]
    done = [r for r in rows if r["status"] == "done"]
    main, counts = token_budgets(done)
    assert main == 20.8 and counts == {82.8: 1, 20.8: 3}
    assert [r["rung"] for r in done if budget(r) != main] == ["S0"]
