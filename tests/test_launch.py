"""Launchers (nlq/experiments/launch.py): the local thread budget, GPUs handed out one per
child with its memory share, and the memory check of a run sharing a GPU
(nlq/run/memory.py), on CPU with the CUDA calls stood in for."""

from __future__ import annotations

import pytest
import torch

from nlq.config import load_config
from nlq.errors import NlqError
from nlq.experiments import launch
from nlq.run import memory


class FakeProc:
    def poll(self):
        return None


@pytest.fixture
def spawned(monkeypatch):
    envs = []
    monkeypatch.setattr(launch, "_spawn", lambda cmd, log, env: envs.append(env) or FakeProc())
    return envs


def test_local_keeps_within_its_thread_budget(spawned):
    local = launch.make_launcher("local", jobs=2, threads=1)
    running = []
    assert local.fits(running, 1)
    running.append(local.start("a", ["train"], None, 1, running))
    assert local.fits(running, 1)
    running.append(local.start("b", ["train"], None, 1, running))
    assert not local.fits(running, 1)  # 2 of 2 threads taken
    assert not local.fits(running[:1], 2)  # a 2-thread replicate waits for room
    assert local.fits([], 8)  # a run larger than the budget runs alone
    assert [e["OMP_NUM_THREADS"] for e in spawned] == ["1", "1"]


def test_gpus_hands_out_the_least_busy_gpu_with_its_share(spawned):
    gpus = launch.Gpus(devices=["0", "3"], per_device=2)
    running = []
    for key in "abcd":
        assert gpus.fits(running, 1)
        running.append(gpus.start(key, ["train"], None, 1, running))
    assert not gpus.fits(running, 1)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in spawned] == ["0", "3", "0", "3"]
    assert {e["NLQ_GPU_SHARE"] for e in spawned} == {"2"}
    running.pop(1)  # a run on GPU 3 ended: the next goes there
    running.append(gpus.start("e", ["train"], None, 1, running))
    assert spawned[-1]["CUDA_VISIBLE_DEVICES"] == "3"


def test_gpus_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(NlqError, match="no CUDA GPU is visible"):
        launch.make_launcher("gpus", jobs=1, threads=1)
    with pytest.raises(NlqError, match="--launcher 'pbs' is not one of local, gpus, slurm"):
        launch.make_launcher("pbs", jobs=1, threads=1)
    with pytest.raises(NlqError, match="--launcher slurm needs --slurm FILE"):
        launch.make_launcher("slurm", jobs=1, threads=1)


def test_a_run_sharing_a_gpu_may_take_its_share_only(monkeypatch):
    """GPT-3 small at 12 x 1024 on a 140 GiB card: alone it fits; with N runs started on the
    card together each may take 1/N, and one N too many is refused naming the share."""
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (140 * gib, 140 * gib))
    cfg, dev = load_config("gpt3-small"), torch.device("cuda")
    need = memory.estimate(cfg, dev).total
    most = int(140 * gib // need)  # the most runs that fit side by side
    assert most >= 2
    memory.check_fits(cfg, dev)
    memory.check_fits(cfg, dev, gpu_share=most)
    with pytest.raises(NlqError, match=f"1/{most + 1} of its 140.0 GiB: {most + 1} runs share"):
        memory.check_fits(cfg, dev, gpu_share=most + 1)


def spec(cfg, threads=1):
    from pathlib import Path

    from nlq.experiments.plan import RunSpec

    return RunSpec("linear", 0, cfg.replace(**{"train.threads": threads}), Path("r"))


def test_jobs_auto_on_a_gpu_is_what_memory_and_cores_allow():
    """--jobs auto on a GPU: the runs one GPU takes at once, bounded by 90% of its memory
    over the largest run's estimate, by the cores (a core per thread per run, shared by the
    GPUs), and by the number of runs; at least 1."""
    from pathlib import Path

    from nlq.experiments.plan import RunSpec, auto_gpu_jobs

    gib = 2 ** 30
    small = load_config("small", {"model.block_size": 256, "train.micro_batch": 8})
    big = load_config("gpt3-small")
    need = memory.estimate(big, torch.device("cuda")).total
    specs = [spec(small)] * 40
    assert auto_gpu_jobs(specs, 1, 16, 140 * gib) == 16  # the cores bound it
    assert auto_gpu_jobs(specs, 8, 16, 140 * gib) == 2  # 16 cores over 8 GPUs
    assert auto_gpu_jobs(specs[:3], 1, 16, 140 * gib) == 3  # no more than the runs
    mixed = specs + [spec(big)]  # the largest run sizes it
    assert auto_gpu_jobs(mixed, 1, 64, 140 * gib) == int(0.9 * 140 * gib // need)
    assert auto_gpu_jobs([spec(big)] * 4, 1, 64, need // 2) == 1  # at least 1
    assert auto_gpu_jobs([spec(small, threads=4)] * 40, 1, 16, 140 * gib) == 4
    # stacks of K: a process holds K runs' memory, and 40 seeds of one config make
    # ceil(40 / K) processes
    seeds = [RunSpec("linear", k, small.replace(**{"train.seed": k}), Path(f"r{k}"))
             for k in range(40)]
    assert auto_gpu_jobs(seeds, 1, 16, 140 * gib, stack=8) == 5
    assert auto_gpu_jobs([spec(big)] * 64, 1, 64, 140 * gib, stack=4) == int(
        0.9 * 140 * gib // (4 * need))


def test_stack_groups_hold_seeds_of_one_config_in_one_state(tmp_path):
    """Seeds of one arm and lr, all new or all resumed from one checkpoint step, at most K a
    group, in plan order; replicates and other configs apart."""
    from pathlib import Path

    from nlq.experiments.plan import RunSpec, stack_groups

    base = load_config("small")

    def run(arm, k, lr=1e-3, state="new", at=None):
        d = tmp_path / f"{arm}-{lr}-{k}"
        if at is not None:
            (d / "ckpt").mkdir(parents=True)
            (d / "ckpt" / "latest").write_text(f"step_{at:06d}\n")
        cfg = base.replace(**{"train.seed": k, "data.seed": 7 + k, "train.lr": lr})
        return RunSpec(arm, k, cfg, Path(d)), state

    todo = [run("a", 0), run("a", 1), run("a", 2), run("b", 0), run("a", 3, lr=2e-3),
            run("a", 4, state="resume", at=100), run("a", 5, state="resume", at=100),
            run("a", 6, state="resume", at=200)]
    names = [[f"{s.arm}{s.seed_index}" for s in g] for g in stack_groups(todo, 2)]
    assert names == [["a0", "a1"], ["a2"], ["b0"], ["a3"], ["a4", "a5"], ["a6"]]
    assert [len(g) for g in stack_groups(todo, 1)] == [1] * 8


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_jobs_is_one_error(value, tmp_path):
    from helpers import assert_user_error, nlq

    p = nlq("reproduce", "--preset", "tiny", "--jobs", value, "--out", str(tmp_path / "o"))
    assert_user_error(p, "--jobs")
    assert not (tmp_path / "o").exists()
