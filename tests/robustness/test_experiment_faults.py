"""Faults in an experiment's runs (nlq/experiments/runner.py).

SIGTERM or SIGINT to `nlq reproduce` while two runs train: no new run starts, every running
child checkpoints and stops (no orphan keeps training), the command exits 128 + the signal
naming what to do, and the same command then continues to the numbers of an uninterrupted
experiment, bitwise. A child killed (SIGKILL, as the out-of-memory killer does): the run is
marked failed with its cause, the others go on, the next command retries it; a run that fails
twice the same way stops the command with one line naming the run and the cause."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import (
    assert_user_error,
    children_of,
    last_step,
    make_data,
    nlq,
    nlq_cmd,
    ok,
    stoppable_experiment,
)
from test_reproduce import SETS as MINI_SETS

# the mini experiment's arms and settings, 60 steps, evaluated only at the end
EXPERIMENT, SETS = stoppable_experiment(MINI_SETS, max_steps=60, eval_interval=100)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("signals")
    make_data(tmp / "data")
    exp = tmp / "signals.toml"
    exp.write_text(EXPERIMENT)
    sets = [a for s in SETS + [f'data.dir="{tmp / "data"}"'] for a in ("--set", s)]
    return tmp, ["reproduce", "--experiment", str(exp), "--seeds", "2", "--jobs", "2", *sets]


@pytest.fixture(scope="module")
def uninterrupted(setting):
    tmp, args = setting
    ok(nlq(*args, "--out", str(tmp / "ref"), timeout=600))
    return tmp / "ref"


@pytest.mark.parametrize("sig", [signal.SIGTERM,
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_signal_stops_every_run_and_the_rerun_continues_exactly(sig, setting, uninterrupted):
    tmp, args = setting
    out = tmp / f"out-{sig.name}"
    runs = [out / "runs" / arm / f"seed{k}" for arm in ("linear", "nonlinear") for k in (0, 1)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # the signal goes to the command alone (kill PID), not to its process group
    p = subprocess.Popen(nlq_cmd(*args, "--out", str(out)), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.time() + 300
    while sum(last_step(r) >= 6 for r in runs) < 2:  # two runs (--jobs 2) under way
        assert p.poll() is None and time.time() < deadline, "the runs never got going"
        time.sleep(0.2)
    started = [r for r in runs if last_step(r) >= 6]
    assert len(children_of(out)) == 2
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 128 + sig, err
    assert f"stopped by signal {int(sig)}" in err and "run the same command again" in err
    assert "Traceback" not in err
    assert children_of(out) == []  # no orphan keeps training
    for r in runs:
        assert not (r / "summary.json").exists()  # 60 steps: none had finished
        # the running ones stopped at a checkpoint; the queued ones never started
        assert any((r / "ckpt").glob("step_*")) == (r in started)
    ok(nlq(*args, "--out", str(out), timeout=600))
    for r in runs:
        ref = uninterrupted / r.relative_to(out)
        a = json.loads((ref / "summary.json").read_text())
        b = json.loads((r / "summary.json").read_text())
        assert (a["step"], a["val_loss"], a["test_loss"]) == (b["step"], b["val_loss"],
                                                              b["test_loss"])


@pytest.mark.parametrize("fault,cause", [
    ("step@3", "killed by signal 9"),  # SIGKILLed after its third step, as by the OOM killer
    # a (faked) CUDA out-of-memory error in its third step
    pytest.param("oom@3", "out of memory", marks=pytest.mark.slow),
])
def test_a_failed_run_is_retried_once_then_named(setting, uninterrupted, fault, cause):
    tmp, args = setting
    out = tmp / f"out-{fault}"
    kill = {"NLQ_FAULT": fault}  # every run fails so
    p = nlq(*args, "--out", str(out), timeout=600, **kill)
    assert p.returncode == 1 and cause in p.stdout, p.stdout
    causes = json.loads((out / "failures.json").read_text())
    assert len(causes) == 4 and all(cause in c for c in causes.values())
    assert "Traceback" not in (out / "runs" / "linear" / "seed0" / "train.log").read_text()
    p = nlq(*args, "--out", str(out), timeout=600, **kill)  # the same way again
    last = assert_user_error(p, "failed twice the same way", cause, "runs/")
    assert p.returncode == 2 and "3 more" in last
    ok(nlq(*args, "--out", str(out), timeout=600))  # the cause removed: resumed, finished
    assert json.loads((out / "failures.json").read_text()) == {}
    for arm in ("linear", "nonlinear"):
        for k in (0, 1):
            a = json.loads((uninterrupted / "runs" / arm / f"seed{k}" / "summary.json").read_text())
            b = json.loads((out / "runs" / arm / f"seed{k}" / "summary.json").read_text())
            assert (a["val_loss"], a["test_loss"]) == (b["val_loss"], b["test_loss"])
