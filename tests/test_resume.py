"""Exact resume: a real `nlq train` subprocess killed (SIGKILL at an injected fault point or
from outside), stopped (SIGINT / SIGTERM) or diverged, then `nlq train --resume`, ends with
the weights, optimizer state and metrics of the uninterrupted run, bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import helpers
import pytest
from helpers import (
    SHORT,
    assert_same_final,
    assert_user_error,
    final_ckpt,
    interrupted_step,
    kill_group,
    metrics,
    n_rows,
    nlq_cmd,
    nlq_resume,
    nlq_train,
    ok,
    popen_group,
    reference_run,
    shared_data,
    snapshot,
    tiny_config,
    untimed,
    wait_for,
    write_config,
)

from nlq.cli import main as nlq_main

one_thread = helpers.one_thread  # autouse: tiny models run ~10x faster on one thread

# a few seconds of training, to be signalled or killed mid-run
LONG = {"model.d_model": 64, "model.n_layer": 2, "model.block_size": 32, "train.micro_batch": 8,
        "train.max_steps": 400, "train.ckpt_interval": 100, "train.eval_interval": 100,
        "model.dropout": 0.1}
TIMING = ("elapsed_s", "tok_per_s")


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    cfg = tiny_config(shared_data(tmp_path_factory), **SHORT)
    return cfg, reference_run(tmp_path_factory, cfg)


@pytest.fixture(scope="module")
def long(tmp_path_factory):
    cfg = tiny_config(shared_data(tmp_path_factory), **LONG)
    return cfg, reference_run(tmp_path_factory, cfg)


def summary(run_dir):
    s = json.loads((run_dir / "summary.json").read_text())
    return {k: v for k, v in s.items() if k not in TIMING}


def assert_same_run(ref, run):
    """Bitwise-equal final weights and AdamW state; equal metrics rows and summary."""
    assert_same_final(ref, run)
    assert untimed(metrics(run)) == untimed(metrics(ref))
    assert summary(run) == summary(ref)


def killed_then_resumed(cfg, ref, tmp_path, fault):
    run = tmp_path / "run"
    p = nlq_train(write_config(tmp_path / "config.toml", cfg), run, NLQ_FAULT=fault)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr)
    assert not (run / "summary.json").exists()
    ok(nlq_resume(run))
    assert_same_run(ref, run)
    return run


def test_resume_after_kill_in_checkpoint_write(short, tmp_path, capsys):
    """Killed between the optimizer file and state.json of the 2nd checkpoint: the partial
    dir is ignored, the run resumes from step 2; resuming the finished run does nothing."""
    cfg, ref = short
    run = killed_then_resumed(cfg, ref, tmp_path, "ckpt_optim@2")
    assert not list((run / "ckpt").glob(".tmp*"))
    before = snapshot(run)
    assert nlq_main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "already finished at step 8" in capsys.readouterr().err
    assert snapshot(run) == before
    # a finished run's config.toml is still checked: an edit is named, not passed over
    conf = (run / "config.toml").read_text()
    (run / "config.toml").write_text(conf.replace("max_steps = 8", "max_steps = 9"))
    assert nlq_main(["train", "--resume", str(run), "--no-progress"]) == 2
    assert "train.max_steps = 8 -> 9" in capsys.readouterr().err
    (run / "config.toml").write_text(conf + "\n[extra]\n")
    assert nlq_main(["train", "--resume", str(run), "--no-progress"]) == 2
    assert "extra" in capsys.readouterr().err


FAULTS = ["step@1",  # before the first checkpoint: resume starts again from step 0
          "step@3", "eval@3", "eval@5", "ckpt_model@1", "ckpt_model@3", "ckpt_state@2",
          "ckpt_rename@2", "ckpt_latest@2",
          "ckpt_latest@4"]  # after the final checkpoint, before summary.json


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_resume_after_fault(short, tmp_path, fault):
    killed_then_resumed(*short, tmp_path, fault)


def start(cfg, tmp_path) -> tuple[subprocess.Popen, object]:
    run = tmp_path / "run"
    cmd = nlq_cmd("train", write_config(tmp_path / "c.toml", cfg), "--out", run, "--no-progress")
    return popen_group(cmd), run


@pytest.mark.slow
def test_resume_after_external_kill(long, tmp_path):
    cfg, ref = long
    proc, run = start(cfg, tmp_path)
    try:
        wait_for(lambda: n_rows(run, "train") > 0, what="the first train row")
        delay = random.uniform(0.0, 1.0)  # anywhere: a step, an eval, a checkpoint write
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == -signal.SIGKILL, f"finished before the kill (delay {delay:.2f}s)"
    ok(nlq_resume(run))
    assert_same_run(ref, run)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_at_a_step_boundary(long, tmp_path, sig):
    cfg, ref = long
    proc, run = start(cfg, tmp_path)
    try:
        wait_for(lambda: n_rows(run, "train") >= 5, what="training to start")
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    k = interrupted_step(proc.returncode, out, err, sig)
    assert 5 <= k < cfg.train.max_steps
    assert final_ckpt(run).name == f"step_{k:06d}"
    assert json.loads((final_ckpt(run) / "state.json").read_text())["step"] == k
    assert metrics(run, "train")[-1]["step"] == k
    assert not (run / "summary.json").exists()
    ok(nlq_resume(run))
    assert_same_run(ref, run)


def diverge(cfg, tmp_path):
    run = tmp_path / "run"
    p = nlq_train(write_config(tmp_path / "config.toml", cfg), run, NLQ_FAULT="nan@5")
    assert p.returncode not in (0, -signal.SIGKILL)
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert_user_error(p, "diverged at step 5")
    assert not (run / "summary.json").exists()
    assert final_ckpt(run).name == "step_000004"
    return run


def test_divergence_keeps_the_last_checkpoint(short, tmp_path):
    """A NaN loss at step 5: exit != 0, one stderr line naming step 5, no summary; the
    checkpoint of step 4 is byte for byte the one the uninterrupted run wrote."""
    cfg, ref = short
    run = diverge(cfg, tmp_path)
    for f in ("model.safetensors", "optim.safetensors"):
        a = (run / "ckpt" / "step_000004" / f).read_bytes()
        assert a == (ref / "ckpt" / "step_000004" / f).read_bytes(), f


@pytest.mark.slow
def test_divergence_then_resume(short, tmp_path):
    """Diverging again right after resuming overwrites nothing; without the fault the run
    resumes from step 4 to the uninterrupted result."""
    cfg, ref = short
    run = diverge(cfg, tmp_path)
    before = snapshot(run / "ckpt")
    assert_user_error(nlq_resume(run, NLQ_FAULT="nan@1"), "diverged at step 5")
    assert snapshot(run / "ckpt") == before
    ok(nlq_resume(run))
    assert_same_run(ref, run)


def test_signal_before_the_first_step(tmp_path_factory, tmp_path, monkeypatch):
    """Stopped during the step-0 eval: nothing is saved (an AdamW without state would not
    resume exactly), and --resume starts the run again to the uninterrupted result."""
    from nlq.model import Transformer
    from nlq.train import loop

    cfg = tiny_config(shared_data(tmp_path_factory))
    forward = Transformer.forward

    def signalling_forward(self, *a, **k):
        if not self.training:  # SIGINT: if train() had no handler, pytest stops, loudly
            os.kill(os.getpid(), signal.SIGINT)
        return forward(self, *a, **k)

    monkeypatch.setattr(Transformer, "forward", signalling_forward)
    assert loop.train(cfg, tmp_path / "run", progress=False) == {"status": "interrupted",
                                                                 "step": 0}
    assert not (tmp_path / "run" / "ckpt").exists()
    monkeypatch.setattr(Transformer, "forward", forward)
    loop.train(cfg, tmp_path / "run", resume=True, progress=False)
    loop.train(cfg, tmp_path / "ref", progress=False)
    assert_same_final(tmp_path / "ref", tmp_path / "run")
    assert untimed(metrics(tmp_path / "run")) == untimed(metrics(tmp_path / "ref"))


def test_fault_points_are_read_once_and_checked(monkeypatch):
    """Without NLQ_FAULT nothing is hooked into a run; a spec is parsed once, and a misspelt
    point is an error rather than a crash test that never crashes."""
    from nlq.errors import NlqError
    from nlq.train import faults

    monkeypatch.delenv("NLQ_FAULT", raising=False)
    assert faults.from_env() is None
    monkeypatch.setenv("NLQ_FAULT", "step@3, nan")
    assert faults.from_env().armed == {"step": 3, "nan": 1}
    monkeypatch.setenv("NLQ_FAULT", "stpe@3")
    with pytest.raises(NlqError, match="stpe@3"):
        faults.from_env()
