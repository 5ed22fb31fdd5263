"""Robustness of run dirs and of the bookkeeping files nlq reads back.

- A start that fails before the run is set up leaves nothing (and never removes what was
  there); the corrected command then runs into the same --out.
- A new run refuses a folder holding files that are not nlq's, leaving them byte-identical;
  no file of a run dir is written through a symlink.
- --resume refuses a config.toml edited since the checkpoint, or other data (another working
  directory resolving a relative data.dir to other shards), naming what changed; data moved
  with identical files resumes, saying so; an older checkpoint without the record resumes
  with a warning.
- Broken bookkeeping (summary.json, metrics.jsonl, test_docs.json, lrs.json, rung.json,
  sweep-plan.json, sweep.json) is skipped and counted, ignored with a warning, or one error
  naming the file, never a traceback.
- `nlq reproduce` (and so `nlq sweep` and `nlq study`) reuses a run only if its config is the
  planned one, key for key, and refuses before writing anything; the committed study's runs
  are still reused.

Processes are zygote children (conftest.py); the rest calls nlq's functions in process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import helpers
import numpy as np
import pytest
from conftest import reference
from helpers import (
    ROOT,
    SHORT,
    assert_same_final,
    assert_user_error,
    make_data,
    metrics,
    ok,
    snapshot,
    stopped_at_6,
    tiny_config,
    untimed,
    write_config,
)

from nlq.config import flatten, load_config, parse_sets
from nlq.errors import NlqError
from nlq.experiments.experiment import load_experiment
from nlq.experiments.reproduce import RunSpec, plan, read_sweep_lrs, run_states, with_lrs
from nlq.report.runs import read_run

one_thread = helpers.one_thread  # autouse: this process compares tensors on one thread


@pytest.fixture(scope="module")
def ref(data, zygote, tmp_path_factory) -> Path:
    return reference(zygote, tmp_path_factory, tiny_config(data, **SHORT))


@pytest.fixture
def good(tmp_path, data) -> Path:
    return write_config(tmp_path / "good.toml", tiny_config(data, **SHORT))


def summary(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    return {k: v for k, v in s.items() if k not in ("elapsed_s", "tok_per_s")}


def train(zygote, cfg: Path, out: Path, *sets: str, **env):
    args = [a for s in sets for a in ("--set", s)]
    return zygote.run("train", cfg, *args, "--out", out, "--no-progress", **env)


# -- a failed start leaves nothing -----------------------------------------------------------


def bad_data(tmp: Path, failure: str) -> Path:
    """A data dir that passes the first check (meta.json and sizes) and fails while the run
    is set up (nlq/run/batches.py): the start that used to leave config.toml behind."""
    if failure == "no test split":  # train.test_eval needs one
        return make_data(tmp / "no-test", n_train=2000, n_val=400, n_test=None)
    d = make_data(tmp / "val-ids", n_train=2000, n_val=400)
    ids = np.fromfile(d / "val.bin", dtype=np.uint16)
    ids[::5] = 310  # meta.json says vocab_size 301
    ids.tofile(d / "val.bin")
    return d


@pytest.mark.parametrize("failure", ["no test split", "val ids beyond the vocab"])
def test_failed_start_leaves_nothing_and_the_corrected_command_runs(failure, tmp_path, good,
                                                                    zygote, ref):
    d = bad_data(tmp_path, failure)
    out = tmp_path / "new" / "deeper" / "run"  # three folders this start makes
    pre = tmp_path / "pre"  # a folder that was there, holding what `nlq reproduce` puts first
    pre.mkdir()
    (pre / "arm.json").write_text('{"arm": "linear", "seed_index": 0}')
    (pre / "train.log").write_text("a log line\n")
    before = snapshot(pre)
    for where in (out, pre):
        p = train(zygote, good, where, f'data.dir="{d}"')
        assert p.returncode == 2, p.stderr
        assert_user_error(p, str(d))
    assert not (tmp_path / "new").exists()
    assert snapshot(pre) == before and sorted(os.listdir(pre)) == ["arm.json", "train.log"]
    for where in (out, pre):  # the corrected command, into the same --out
        ok(train(zygote, good, where))
        assert summary(where) == summary(ref)
    assert (pre / "arm.json").read_bytes() == before["arm.json"]


def test_missing_data_dir_then_the_corrected_command(tmp_path, good, zygote, ref):
    out = tmp_path / "run"
    p = train(zygote, good, out, f'data.dir="{tmp_path / "nowhere"}"')
    assert_user_error(p, str(tmp_path / "nowhere"))
    assert not out.exists()
    ok(train(zygote, good, out))
    assert_same_final(ref, out)


def test_a_run_that_failed_after_its_start_is_resumed(tmp_path, good, zygote, ref):
    """A NaN after the step-2 checkpoint: the run exists (config.toml, the checkpoint) and
    --resume ends as the uninterrupted run."""
    run = tmp_path / "run"
    p = train(zygote, good, run, NLQ_FAULT="nan@3")
    assert_user_error(p, "diverged at step 3")
    assert (run / "config.toml").is_file() and (run / "ckpt" / "step_000002").is_dir()
    ok(zygote.run("train", "--resume", run, "--no-progress"))
    assert_same_final(ref, run)
    assert summary(run) == summary(ref)


# -- folders that are not nlq's, symlinks -----------------------------------------------------


def test_new_run_refuses_a_folder_that_is_not_a_run(tmp_path, good, zygote):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "summary.json").write_text('{"my": "numbers"}\n')
    (mine / "metrics.jsonl").write_text("my own rows\n")
    (mine / "notes.txt").write_text("notes\n")
    (mine / "sub" / "x.bin").write_bytes(bytes(range(256)))
    before = snapshot(mine)
    p = train(zygote, good, mine)
    assert p.returncode == 2
    assert_user_error(p, str(mine), "not an nlq run dir", "metrics.jsonl")
    assert snapshot(mine) == before
    assert sorted(os.listdir(mine)) == ["metrics.jsonl", "notes.txt", "sub", "summary.json"]


def outside_file(tmp: Path) -> Path:
    f = tmp / "outside" / "precious.txt"
    f.parent.mkdir()
    f.write_text("precious\n")
    return f


def test_lock_symlink_is_never_written_through(tmp_path, good, zygote, ref):
    outside = outside_file(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".lock").symlink_to(outside)
    p = train(zygote, good, empty)
    assert_user_error(p, str(empty), "not an nlq run dir", ".lock (a symbolic link)")
    assert os.listdir(empty) == [".lock"] and (empty / ".lock").is_symlink()
    stopped = stopped_at_6(ref, tmp_path / "stopped")
    (stopped / ".lock").unlink(missing_ok=True)
    (stopped / ".lock").symlink_to(outside)
    before = snapshot(stopped)
    p = zygote.run("train", "--resume", stopped, "--no-progress")
    assert_user_error(p, str(stopped / ".lock"), "symbolic link")
    assert snapshot(stopped) == before
    assert outside.read_text() == "precious\n"


def test_metrics_symlink_is_never_written_through(tmp_path, zygote, ref):
    outside = outside_file(tmp_path)
    run = stopped_at_6(ref, tmp_path / "run")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(outside)
    p = zygote.run("train", "--resume", run, "--no-progress")
    assert_user_error(p, str(run / "metrics.jsonl"), "symbolic link")
    assert outside.read_text() == "precious\n"


def test_temp_file_symlinks_are_replaced_not_followed(tmp_path, zygote, ref):
    """Links planted where nlq writes its temporary files (summary.json, test_docs.json,
    ckpt/latest): the resume replaces them, finishes as the uninterrupted run, and the file
    they point to is unchanged."""
    outside = outside_file(tmp_path)
    run = stopped_at_6(ref, tmp_path / "run")
    for tmp in (run / ".summary.json.tmp", run / ".test_docs.json.tmp",
                run / "ckpt" / ".latest.tmp"):
        tmp.symlink_to(outside)
    ok(zygote.run("train", "--resume", run, "--no-progress"))
    assert outside.read_text() == "precious\n"
    assert not (run / "summary.json").is_symlink() and summary(run) == summary(ref)
    assert_same_final(ref, run)


# -- resume checks what the run depends on ----------------------------------------------------


@pytest.mark.parametrize("key,new", [("train.lr", 0.02), ("data.seed", 8),
                                     ("train.max_steps", 10)])
def test_resume_refuses_an_edited_config(key, new, tmp_path, zygote, ref):
    run = stopped_at_6(ref, tmp_path / "run")
    cfg = load_config(run / "config.toml")
    old = flatten(cfg.to_dict())[key]
    (run / "config.toml").write_text(cfg.replace(**{key: new}).to_toml())
    before = snapshot(run)
    p = zygote.run("train", "--resume", run, "--no-progress")
    assert p.returncode == 2
    assert_user_error(p, str(run / "config.toml"), "changed since checkpoint", "step_000006",
                      f"{key} = {old!r} -> {new!r}")
    assert snapshot(run) == before


def test_resume_from_another_working_directory(tmp_path, tmp_path_factory, data, zygote):
    """data.dir = "data", relative: resumed from another working directory it is other
    files. Other shards: refused naming the file and both folders. Identical shards
    elsewhere (a moved or copied data dir, also written into config.toml): the run continues,
    saying so, and ends as the uninterrupted run."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, c):
        shutil.copytree(data, d / "data")
    shutil.copytree(data, b / "data")
    ids = np.fromfile(b / "data" / "train.bin", dtype=np.uint16)
    ids[1000] = (ids[1000] + 1) % 300  # one token: the same size, other content
    ids.tofile(b / "data" / "train.bin")
    cfg = write_config(tmp_path / "rel.toml", tiny_config("data", **SHORT))
    ref = tmp_path / "ref"
    ok(zygote.start("train", cfg, "--out", ref, "--no-progress", cwd=a).wait())

    other = stopped_at_6(ref, tmp_path / "other")
    before = snapshot(other)
    p = zygote.start("train", "--resume", other, "--no-progress", cwd=b).wait()
    assert_user_error(p, "train.bin (same size, other sha256)", str((b / "data").resolve()),
                      str((a / "data").resolve()), "step_000006")
    assert snapshot(other) == before

    moved = stopped_at_6(ref, tmp_path / "moved")
    p = ok(zygote.start("train", "--resume", moved, "--no-progress", cwd=c).wait())
    moved_to = f"{(a / 'data').resolve()} -> {(c / 'data').resolve()}"
    assert f"nlq: warning: data dir moved: {moved_to}" in p.stderr, p.stderr
    assert_same_final(ref, moved)

    edited = stopped_at_6(ref, tmp_path / "edited")
    (edited / "config.toml").write_text(
        load_config(edited / "config.toml").replace(**{"data.dir": str(c / "data")}).to_toml())
    p = ok(zygote.run("train", "--resume", edited, "--no-progress"))
    assert "data dir moved" in p.stderr
    assert_same_final(ref, edited)
    assert untimed(metrics(edited)) == untimed(metrics(ref))


def test_checkpoint_without_a_record_resumes_with_a_warning(tmp_path, zygote, ref):
    """A checkpoint of an older nlq (no "depends" in state.json): one warning, then the same
    run as the uninterrupted one."""
    run = stopped_at_6(ref, tmp_path / "run")
    st = run / "ckpt" / "step_000006" / "state.json"
    state = json.loads(st.read_text())
    del state["depends"]
    st.write_text(json.dumps(state))
    p = ok(zygote.run("train", "--resume", run, "--no-progress"))
    warnings = [ln for ln in p.stderr.splitlines() if ln.startswith("nlq: warning:")]
    assert len(warnings) == 1 and "records neither the config nor the data" in warnings[0]
    assert_same_final(ref, run)


# -- broken bookkeeping files -------------------------------------------------------------------


@pytest.mark.parametrize("body,why", [("{\"status\": \"fini", "is not valid JSON"),
                                      ('{"status": "finished"}', "no integer step"),
                                      ("[1, 2]", "not a finished run's summary")])
def test_resume_with_a_broken_summary_writes_it_again(body, why, tmp_path, zygote, ref):
    """summary.json of a finished run, broken: --resume says so and recomputes it from the
    final checkpoint, as the run wrote it."""
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    (run / "summary.json").write_text(body)
    p = ok(zygote.run("train", "--resume", run, "--no-progress"))
    assert f"nlq: warning: {run / 'summary.json'}" in p.stderr and why in p.stderr, p.stderr
    assert summary(run) == summary(ref)
    assert untimed(metrics(run)) == untimed(metrics(ref))
    assert_same_final(ref, run)


def test_report_skips_bad_lines_and_values(tmp_path, zygote, ref):
    """metrics.jsonl lines with a non-numeric or boolean step, no val_loss, val_loss null, a
    JSON array, bytes that are not UTF-8; summary.json values of the wrong type; a broken
    test_docs.json and lrs.json: `nlq report` finishes, counting and naming what it skipped."""
    exp = tmp_path / "exp"
    runs = [exp / "runs" / "linear" / f"seed{k}" for k in (0, 1)]
    for k, r in enumerate(runs):
        shutil.copytree(ref, r, ignore=shutil.ignore_patterns("ckpt", "tb"))
        (r / "arm.json").write_text(json.dumps({"arm": "linear", "seed_index": k}))
    bad = [b'{"kind": "eval", "step": "x", "val_loss": 1.0}', b'{"kind": "eval", "step": 3}',
           b'{"kind": "eval", "step": 4, "val_loss": null}',
           b'{"kind": "eval", "step": true, "val_loss": 1.0}', b"[1, 2]",
           b'{"kind": "eval", "step": 5, "val_loss": 1.0, \xff\xfe']
    with open(runs[0] / "metrics.jsonl", "ab") as f:
        f.write(b"\n".join(bad) + b"\n")
    s = json.loads((runs[1] / "summary.json").read_text())
    (runs[1] / "summary.json").write_text(json.dumps({**s, "n_spikes": "x", "tokens": None}))
    (runs[1] / "test_docs.json").write_text("{")
    (exp / "lrs.json").write_text("[")
    assert read_run(runs[0]).evals == read_run(ref).evals
    p = ok(zygote.run("report", exp, "--out", tmp_path / "rep"))
    assert "Traceback" not in p.stderr
    assert f"nlq: warning: {exp / 'lrs.json'} is not valid JSON" in p.stderr
    notes = json.loads((tmp_path / "rep" / "report.json").read_text())["notes"]
    assert f"{runs[0].resolve()}: 6 unreadable line(s) in metrics.jsonl skipped" in notes
    assert any(str(runs[1].resolve()) in n and "n_spikes = 'x'" in n and "tokens = None" in n
               for n in notes), notes


def test_experiment_bookkeeping_errors_name_the_file(tmp_path):
    from nlq.experiments.study import check_rung
    from nlq.experiments.sweep import sweep

    rung = tmp_path / "rung"
    rung.mkdir()
    (rung / "rung.json").write_text("{not json")
    with pytest.raises(NlqError, match=re.escape(f"{rung / 'rung.json'} cannot be read")):
        check_rung(rung, {"name": "S0"})
    (rung / "rung.json").write_text("[]")
    with pytest.raises(NlqError, match="is not a rung record"):
        check_rung(rung, {"name": "S0"})

    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep-plan.json").write_text('{"seeds": ')
    with pytest.raises(NlqError, match=re.escape(f"{out / 'sweep-plan.json'} cannot be read")):
        sweep("paper", "tiny", ["linear"], [1e-3, 2e-3, 4e-3], 2, out, 1)
    assert sorted(os.listdir(out)) == ["sweep-plan.json"]

    f = tmp_path / "sweep.json"
    f.write_text(json.dumps({"preset": "tiny", "sets": {}, "chosen": {"linear": {"lr": "x"}}}))
    with pytest.raises(NlqError, match=r"chosen\.linear\.lr is 'x'"):
        read_sweep_lrs(f, "tiny", {}, ["linear"])
    f.write_text(json.dumps({"preset": "tiny", "sets": {}, "chosen": [1]}))
    with pytest.raises(NlqError, match="not a sweep.json"):
        read_sweep_lrs(f, "tiny", {}, ["linear"])


# -- reproduce reuses a run only of the same config -----------------------------------------


EXPERIMENT = """
name = "two"
baseline = "linear"
[arms.linear]
[arms.nonlinear]
model.query = "nonlinear"
"""


def two_arm_setting(tmp: Path, data: Path, steps: int) -> tuple[Path, list[str]]:
    exp = tmp / "two.toml"
    exp.write_text(EXPERIMENT)
    sets = [f"{section}.{k}={json.dumps(v)}" for section in ("model", "train")
            for k, v in helpers.TINY[section].items() if k != "max_steps"]
    sets += [f'data.dir="{data}"', f"train.max_steps={steps}"]
    return exp, sets


def finished_like(spec: RunSpec, ref: Path) -> None:
    """spec's run dir as a finished run of spec's config (ref's files for the numbers)."""
    spec.run_dir.mkdir(parents=True)
    for name in ("summary.json", "metrics.jsonl", "test_docs.json"):
        shutil.copy2(ref / name, spec.run_dir / name)
    write_config(spec.run_dir / "config.toml", spec.cfg)
    (spec.run_dir / "arm.json").write_text(json.dumps({"arm": spec.arm,
                                                      "seed_index": spec.seed_index}))


def test_reproduce_reuses_only_runs_of_the_same_config(tmp_path, data, zygote, ref):
    """4-step runs in OUT; the command again with train.max_steps=8 is refused naming the key
    (4 there, 8 now) and writes nothing (configs/*.toml and experiment.toml included); with
    the same setting every run is finished already and nothing is trained."""
    out = tmp_path / "out"
    exp, sets4 = two_arm_setting(tmp_path, data, 4)
    specs = plan(load_experiment(exp), "tiny", 2, None, out, parse_sets(sets4))
    for s in specs:
        finished_like(s, ref)
    before = snapshot(out)
    _, sets8 = two_arm_setting(tmp_path, data, 8)
    args = ["reproduce", "--experiment", exp, "--preset", "tiny", "--seeds", "2", "--out", out,
            "--jobs", "1"]
    p = zygote.run(*args, *[a for s in sets8 for a in ("--set", s)])
    assert p.returncode == 2
    assert_user_error(p, str(specs[0].run_dir), "another config",
                      "train.max_steps = 4 there, 8 now")
    assert snapshot(out) == before and sorted(os.listdir(out)) == ["runs"]
    runs = snapshot(out / "runs")
    p = ok(zygote.run(*args, *[a for s in sets4 for a in ("--set", s)]))
    assert "all 4 runs finished already" in p.stderr
    assert snapshot(out / "runs") == runs


def test_reproduce_states_of_broken_run_dirs(tmp_path, data, ref, capsys):
    exp, sets = two_arm_setting(tmp_path, data, 8)
    spec = plan(load_experiment(exp), "tiny", 2, ["linear"], tmp_path / "out",
                parse_sets(sets))[0]
    finished_like(spec, ref)
    assert run_states([spec]) == {spec.run_dir: "finished"}
    (spec.run_dir / "summary.json").write_text("{")
    with pytest.raises(NlqError, match="no checkpoint to recompute it from"):
        run_states([spec])
    shutil.copytree(ref / "ckpt", spec.run_dir / "ckpt")
    assert run_states([spec]) == {spec.run_dir: "resume"}
    assert "is not valid JSON" in capsys.readouterr().err
    (spec.run_dir / "config.toml").unlink()
    with pytest.raises(NlqError, match="summary.json but no config.toml"):
        run_states([spec])


def test_committed_study_runs_are_reused():
    """Every finished run of the committed study (results/study: config.toml and summary.json
    per run) is "finished" for the plan `nlq study` makes from it today: a study continued
    from it trains none of them again."""
    from nlq.experiments.ladder import load_ladder
    from nlq.experiments.sweep import sweep_plan

    root = ROOT / "results" / "study"
    rungs = sorted(p.parent for p in root.glob("*/rung.json"))
    if not rungs:
        pytest.skip("no committed study")
    ladder = load_ladder()
    n = 0
    for d in rungs:
        r = ladder.rungs[d.name]
        grid = json.loads((d / "sweep" / "sweep-plan.json").read_text())["grid"]
        specs, _ = sweep_plan(ladder.experiment, r.preset, ladder.arms or None, grid,
                              r.sweep_seeds, d / "sweep", r.sets)
        if (d / "compare" / "lrs.json").is_file():
            base = plan(load_experiment(ladder.experiment), r.preset, r.seeds,
                        ladder.arms or None, d / "compare", r.sets)
            lrs = read_sweep_lrs(d / "sweep" / "sweep.json", r.preset, r.sets,
                                 sorted({s.arm for s in base}))["lrs"]
            specs += with_lrs(base, lrs)
        states = run_states(specs)
        done = {p.parent for p in d.rglob("summary.json")}
        assert {p for p, st in states.items() if st == "finished"} == done
        n += len(done)
    assert n > 0
