"""Crash consistency: a training process is SIGKILLed at seeded random points spread
over steps, evals and every stage of a checkpoint write (NLQ_FAULT, nlq/train/faults.py),
plus from outside after a random delay; some resumes are killed again. Every time,
`nlq train --resume` completes and the final weights, AdamW state, metrics rows and summary
are those of the uninterrupted run, bit for bit, on CPU.

The default tier forks each `nlq` process from the zygote (conftest.py, about 0.3 s a run);
the slow tier runs the same trials as `python -m nlq` subprocesses. NLQ_CRASH_SEED picks
other points (the default is fixed, so a failure reproduces).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time

import helpers
import pytest
from conftest import reference, subprocess_runner
from helpers import assert_same_final, metrics, tiny_config, untimed, wait_for, write_config

one_thread = helpers.one_thread  # autouse: this process compares tensors on one thread

# 12 steps; eval at 0, 2, ..., 12, 2 val chunks each (14 eval visits, drawn from the first
# 7); checkpoints at 3, 6, 9, 12 (4 visits of each ckpt_* point) keeping 2, so pruning happens
# too; dropout on, so a resumed run must draw the same masks
CRASH = {"train.max_steps": 12, "train.eval_interval": 2, "train.ckpt_interval": 3,
         "train.keep_checkpoints": 2, "train.log_interval": 1, "model.dropout": 0.1}
VISITS = {"step": 12, "eval": 7, "ckpt_model": 4, "ckpt_optim": 4, "ckpt_state": 4,
          "ckpt_rename": 4, "ckpt_latest": 4}
SEED = int(os.environ.get("NLQ_CRASH_SEED", "8"))  # fixed, so a failure reproduces
N_FAULTS, N_EXTERNAL = 10, 2


def plan(seed: int) -> list[dict]:
    """Trials: every kill point at least once, the rest drawn; every third trial's first
    resume is killed again at a second point (its visits count from the resume)."""
    rng = random.Random(seed)
    kinds = list(VISITS) + rng.choices(list(VISITS), k=N_FAULTS - len(VISITS))
    rng.shuffle(kinds)
    trials = []
    for i, k in enumerate(kinds):
        again = rng.choice(list(VISITS)) if i % 3 == 2 else None
        trials.append({"fault": f"{k}@{rng.randint(1, VISITS[k])}",
                       "again": again and f"{again}@{rng.randint(1, VISITS[again] // 2)}"})
    trials += [{"external": rng.uniform(0.1, 0.7)} for _ in range(N_EXTERNAL)]
    return trials


def started(runner, cfg_path, run):
    """`nlq train` started; returns once its run dir is resumable (config.toml written)."""
    proc = runner.start("train", cfg_path, "--out", run, "--no-progress")
    wait_for(lambda: (run / "config.toml").is_file() or proc.poll() is not None,
             what="the run dir")
    return proc


def run_time(runner, cfg_path, run) -> float:
    """Seconds from a resumable run dir to its summary.json (not to the exit: a process
    killed while the interpreter shuts down has finished), measured here and now."""
    proc = started(runner, cfg_path, run)
    t0 = time.monotonic()
    wait_for(lambda: (run / "summary.json").is_file() or proc.poll() is not None,
             what="the summary")
    took = time.monotonic() - t0
    helpers.ok(proc.wait())
    return took


def summary(run):
    s = json.loads((run / "summary.json").read_text())
    return {k: v for k, v in s.items() if k not in ("elapsed_s", "tok_per_s")}


def killed(p) -> bool:
    return p.returncode == -signal.SIGKILL


MODES = ["zygote", pytest.param("subprocess", marks=pytest.mark.slow)]


@pytest.mark.parametrize("mode", MODES)
def test_sigkill_anywhere_then_resume_is_exact(mode, tmp_path, tmp_path_factory, data,
                                               zygote):
    runner = zygote if mode == "zygote" else subprocess_runner(tmp_path_factory)
    cfg = tiny_config(data, **CRASH)
    cfg_path = write_config(tmp_path / "crash.toml", cfg)
    ref = reference(runner, tmp_path_factory, cfg)
    took = run_time(runner, cfg_path, tmp_path / "timing")

    results = []
    for i, trial in enumerate(plan(SEED)):
        run = tmp_path / f"run{i}"
        if "external" in trial:
            delay = trial["external"] * took
            for attempt in range(4):  # a machine that got faster may finish first
                proc = started(runner, cfg_path, run)
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                first = proc.wait()
                if attempt == 3 or (killed(first) and not (run / "summary.json").exists()):
                    break
                shutil.rmtree(run)
                delay /= 2  # kill sooner
            latest = run / "ckpt" / "latest"
            what = (f"kill -9 after {delay:.2f}s (at {helpers.n_rows(run, 'train')} steps "
                    f"logged, latest "
                    f"{latest.read_text().strip() if latest.is_file() else 'none'})")
        else:
            first = runner.run("train", cfg_path, "--out", run, "--no-progress",
                               NLQ_FAULT=trial["fault"])
            what = f"NLQ_FAULT={trial['fault']}"
        lines = [what]
        ok = killed(first) and not (run / "summary.json").exists()
        if not killed(first):
            lines.append(f"not killed: exit {first.returncode} {first.stderr[-300:]}")
        elif not ok:
            lines.append("killed only after it had finished")
        if ok and trial.get("again"):
            again = runner.run("train", "--resume", run, "--no-progress",
                               NLQ_FAULT=trial["again"])
            lines.append(f"resume with NLQ_FAULT={trial['again']}: "
                         f"{'killed' if killed(again) else f'exit {again.returncode}'}")
            ok = killed(again) or again.returncode == 0
        if ok:
            assert (run / ".lock").exists()  # left by the killed process: it must not block
            p = runner.run("train", "--resume", run, "--no-progress")
            ok = p.returncode == 0
            if not ok:
                lines.append(f"resume failed: exit {p.returncode} {p.stderr[-500:]}")
        if ok:
            try:
                assert_same_final(ref, run)
                assert untimed(metrics(run)) == untimed(metrics(ref))
                assert summary(run) == summary(ref)
                assert not list((run / "ckpt").glob(".tmp*"))
                # keep_checkpoints = 2; one more where the kill came between `latest` and
                # the pruning of the final checkpoint (nothing is saved after it to prune)
                kept = sorted(d.name for d in (run / "ckpt").glob("step_*"))
                assert kept[-2:] == ["step_000009", "step_000012"] and len(kept) <= 3, kept
            except AssertionError as e:
                ok = False
                lines.append(f"differs from the uninterrupted run: {e}")
        results.append((ok, "; ".join(lines)))

    n_ok = sum(ok for ok, _ in results)
    print(f"\ncrash consistency (seed {SEED}, {mode}): {n_ok}/{len(results)} killed runs "
          f"resumed bitwise equal to the uninterrupted run")
    for ok, line in results:
        print(f"  {'ok  ' if ok else 'FAIL'} {line}")
    assert n_ok == len(results) >= 10, [line for ok, line in results if not ok]


def test_plan_spreads_over_every_kill_point():
    trials = plan(SEED)
    points = {t["fault"].split("@")[0] for t in trials if "fault" in t}
    assert points == set(VISITS)
    assert sum("external" in t for t in trials) >= 1 and len(trials) >= 10
    assert any(t.get("again") for t in trials)
