"""Distributed `nlq train` (torchrun, gloo on CPU) against one process on the same global
batch: DDP and FSDP2 give the losses, evals and weights of a 1-process run, and a
checkpoint of either world size resumes on the other.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import helpers
import pytest
import torch
from helpers import (
    assert_same_final,
    assert_same_tensors,
    final_ckpt,
    interrupted_step,
    kill_group,
    load_ckpt,
    metrics,
    n_rows,
    nlq_resume,
    nlq_train,
    ok,
    popen_group,
    reference_run,
    shared_data,
    tiny_config,
    torchrun,
    torchrun_cmd,
    untimed,
    wait_for,
    write_config,
)

one_thread = helpers.one_thread  # autouse: tiny models run ~10x faster on one thread

pytestmark = pytest.mark.dist

# grad_accum 2 = one micro-step per rank; eval_batches 3 = 12 val windows over 2 ranks of
# 2 chunks of 4, so the last chunk of rank 1 is padding that must count for nothing
DIST = {"train.max_steps": 4, "train.eval_interval": 2, "train.ckpt_interval": 2,
        "train.eval_batches": 3, "train.grad_accum": 2, "train.keep_checkpoints": 5}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return tiny_config(shared_data(tmp_path_factory), **DIST)


@pytest.fixture(scope="module")
def one(tmp_path_factory, cfg):
    return reference_run(tmp_path_factory, cfg)


def assert_matches(one_proc, run, atol):
    """Same steps, lr and tokens; losses, grad norms, val losses and weights within atol."""
    a, b = metrics(one_proc, "train"), metrics(run, "train")
    assert [(r["step"], r["lr"], r["tokens"]) for r in a] == \
        [(r["step"], r["lr"], r["tokens"]) for r in b]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=atol)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], abs=atol)
    a, b = metrics(one_proc, "eval"), metrics(run, "eval")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert y["val_loss"] == pytest.approx(x["val_loss"], abs=atol)
    assert_same_tensors(load_ckpt(one_proc)[0], load_ckpt(run)[0], atol=atol)


def test_ddp_matches_one_process(tmp_path_factory, cfg, one):
    two = reference_run(tmp_path_factory, cfg, nproc=2)
    assert metrics(two, "meta")[0]["world_size"] == 2
    assert metrics(one, "meta")[0]["world_size"] == 1
    assert_matches(one, two, atol=1e-5)


def test_masked_lm_ddp_matches_one_process(tmp_path_factory, cfg):
    """A masked LM's ranks hold different numbers of targets: the step is the mean over all
    of them (the count all-reduced first), as one process computes it."""
    mlm = cfg.replace(**{"model.arch": "encoder", "train.objective": "mlm",
                         "train.mlm_prob": 0.15, "train.grad_clip": 0.0})
    one_mlm = reference_run(tmp_path_factory, mlm)
    assert_matches(one_mlm, reference_run(tmp_path_factory, mlm, nproc=2), atol=1e-5)


@pytest.mark.slow
def test_fsdp_matches_one_process(tmp_path_factory, cfg, one):
    fsdp = reference_run(tmp_path_factory, cfg.replace(**{"train.parallel": "fsdp"}), nproc=2)
    assert_matches(one, fsdp, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_checkpoint_resumes_on_one(tmp_path, cfg, one, parallel):
    cfg = cfg.replace(**{"train.parallel": parallel})
    run = tmp_path / "run"
    p = torchrun(2, "train", write_config(tmp_path / "c.toml", cfg), "--out", run,
                 "--no-progress", NLQ_FAULT="step@3")  # both ranks die after step 3
    assert p.returncode != 0
    assert [r["step"] for r in metrics(run, "train")] == [1, 2]  # killed before row 3
    ok(nlq_resume(run))  # from the step-2 checkpoint, on one process
    assert [r["step"] for r in metrics(run, "train")] == [1, 2, 3, 4]
    assert_matches(one, run, atol=1e-6)
    assert_same_tensors(load_ckpt(one)[1], load_ckpt(run)[1], atol=1e-6)  # AdamW moments


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_one_process_checkpoint_resumes_on_two(tmp_path, cfg, one, parallel):
    cfg = cfg.replace(**{"train.parallel": parallel})
    run = tmp_path / "run"
    p = nlq_train(write_config(tmp_path / "c.toml", cfg), run, NLQ_FAULT="step@3")
    assert p.returncode == -signal.SIGKILL
    assert [r["step"] for r in metrics(run, "train")] == [1, 2]
    ok(torchrun(2, "train", "--resume", run, "--no-progress"))
    assert [r["step"] for r in metrics(run, "train")] == [1, 2, 3, 4]
    assert_matches(one, run, atol=1e-6)
    assert_same_tensors(load_ckpt(one)[1], load_ckpt(run)[1], atol=1e-6)
    # the run's optimizer state is complete on one process again
    assert torch.equal(load_ckpt(run)[1]["step/wte.weight"], torch.tensor(4.0))


def worker_pid(torchrun_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=rank (a direct child), or None yet."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if f"RANK={rank}".encode() in env:
            return int(stat.parent.name)
    return None


@pytest.mark.slow
def test_signal_to_one_rank_stops_all_at_one_step(tmp_path_factory, tmp_path):
    """SIGTERM reaching only rank 1: every rank stops at the same step boundary, rank 0
    checkpoints, exit 0; --resume on two processes ends bitwise like the uninterrupted run."""
    cfg = tiny_config(shared_data(tmp_path_factory),
                      **{**DIST, "train.max_steps": 300, "train.ckpt_interval": 100,
                         "train.eval_interval": 100, "model.dropout": 0.1})
    ref = reference_run(tmp_path_factory, cfg, nproc=2)
    run = tmp_path / "run"
    proc = popen_group(torchrun_cmd(2, "train", write_config(tmp_path / "c.toml", cfg),
                                    "--out", run, "--no-progress"))
    try:
        wait_for(lambda: n_rows(run, "train") >= 5, what="training to start")
        pid = worker_pid(proc.pid, 1)
        assert pid is not None, "no rank-1 worker found"
        os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    k = interrupted_step(proc.returncode, out, err, signal.SIGTERM)
    assert final_ckpt(run).name == f"step_{k:06d}"
    ok(torchrun(2, "train", "--resume", run, "--no-progress"))
    assert_same_final(ref, run)
    assert untimed(metrics(run)) == untimed(metrics(ref))
