"""Seeds trained as one stacked model (nlq/train/stack.py) against the same seeds trained
alone: the same losses, grad norms and final val loss to float rounding (the lone runs use
the CPU kernels, the stack the plain model), a per-member grad clip (the configs clip hard,
so a clip over the whole stack would show), an exact stacked resume, and a member's
checkpoint that a lone `nlq train --resume` continues."""

from __future__ import annotations

import json
import shutil

import helpers
import pytest
from helpers import assert_same_final, metrics, shared_data, tiny_config, untimed, write_config

from nlq.cli import main as nlq_main
from nlq.errors import NlqError
from nlq.train.loop import train
from nlq.train.stack import train_stack

one_thread = helpers.one_thread
# vmap runs CPU attention seed by seed (no batching rule there): correct, and said once
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

# clip hard (the tiny model's grad norms start near 1-3): a clip taken over the whole stack
# instead of per member would change every step
STACK = {"model.query": "nonlinear", "train.max_steps": 12, "train.eval_interval": 6,
         "train.ckpt_interval": 6, "train.keep_checkpoints": 10, "train.grad_clip": 0.3,
         "train.test_eval": True}


def member_cfgs(data, n=2, **extra):
    return [tiny_config(data, **{**STACK, "train.seed": 3 + k, "data.seed": 7 + k, **extra})
            for k in range(n)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two seeds trained as one stack, and each trained alone."""
    data = shared_data(tmp_path_factory)
    base = tmp_path_factory.mktemp("stack")
    cfgs = member_cfgs(data)
    stacked = [base / "stack" / f"seed{k}" for k in range(2)]
    alone = [base / "alone" / f"seed{k}" for k in range(2)]
    summaries = train_stack(cfgs, stacked, progress=False)
    lone = [train(c, d, progress=False) for c, d in zip(cfgs, alone)]
    return cfgs, stacked, alone, summaries, lone


def test_stacked_members_are_the_lone_runs(runs):
    _, stacked, alone, summaries, lone = runs
    for s_dir, a_dir, s, a in zip(stacked, alone, summaries, lone):
        rows_s, rows_a = metrics(s_dir, "train"), metrics(a_dir, "train")
        assert [r["step"] for r in rows_s] == [r["step"] for r in rows_a] == list(range(1, 13))
        assert min(r["grad_norm"] for r in rows_a) > 2 * STACK["train.grad_clip"]  # clipped
        for rs, ra in zip(rows_s, rows_a):
            assert rs["lr"] == ra["lr"]
            assert rs["loss"] == pytest.approx(ra["loss"], rel=1e-4)
            assert rs["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-3)
        assert s["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4)
        assert s["test_loss"] == pytest.approx(a["test_loss"], rel=1e-4)
        assert s["stack"] == 2 and "stack" not in a
        assert set(s) - {"stack"} == set(a)  # the same summary, member by member
        assert metrics(s_dir, "meta")[0]["stack"] == 2
    # the two members are two different runs (seeds), not one run twice
    assert summaries[0]["val_loss"] != summaries[1]["val_loss"]


def stopped_at_6(src, dst):
    """A copy of a finished run as if killed just after its step-6 checkpoint."""
    shutil.copytree(src, dst)
    (dst / "summary.json").unlink()
    shutil.rmtree(dst / "ckpt" / "step_000012")
    (dst / "ckpt" / "latest").write_text("step_000006\n")
    return dst


def test_stack_resumes_exactly(runs, tmp_path):
    _, stacked, _, summaries, _ = runs
    dirs = [stopped_at_6(d, tmp_path / d.name) for d in stacked]
    out = train_stack(None, dirs, resume=True, progress=False)
    for d, ref, s, r in zip(dirs, stacked, out, summaries):
        assert untimed(metrics(d)) == untimed(metrics(ref))
        assert_same_final(d, ref)  # bitwise: weights and AdamW state
        assert s["val_loss"] == r["val_loss"] and s["test_loss"] == r["test_loss"]


def test_a_member_resumes_alone(runs, tmp_path):
    """A member's checkpoint is a lone run's: `nlq train --resume` continues it alone."""
    _, stacked, _, _, lone = runs
    d = stopped_at_6(stacked[1], tmp_path / "member")
    s = train(None, d, resume=True, progress=False)
    assert s["step"] == 12
    assert s["val_loss"] == pytest.approx(lone[1]["val_loss"], rel=1e-4)


def test_finished_members_are_skipped_and_mixed_steps_refused(runs, tmp_path):
    _, stacked, _, summaries, _ = runs
    done = tmp_path / "done"
    shutil.copytree(stacked[0], done)
    assert train_stack(None, [done, stacked[0]], resume=True, progress=False)[0] == summaries[0]
    a = stopped_at_6(stacked[0], tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(stacked[1], b)
    (b / "summary.json").unlink()  # at its step-12 checkpoint: the final boundary only
    with pytest.raises(NlqError, match="checkpoints of one step"):
        train_stack(None, [a, b], resume=True, progress=False)


def test_a_diverged_member_leaves_the_others_unchanged(runs, tmp_path, monkeypatch):
    """Member 1's weights turned to NaN before step 4: it stops as a lone run stops (no
    summary), member 0 trains on to bitwise what it gave in the stack of two, and the command
    fails naming member 1."""
    import torch

    from nlq.train.loop import Diverged
    from nlq.train.stacked import Stack

    cfgs, stacked, _, summaries, _ = runs
    step = Stack.step

    def poisoned(self, i):
        if i == 3:
            with torch.no_grad():
                self.params["wte.weight"][1].fill_(float("nan"))
        return step(self, i)

    monkeypatch.setattr(Stack, "step", poisoned)
    dirs = [tmp_path / "a", tmp_path / "b"]
    with pytest.raises(Diverged, match="b: training diverged at step 4"):
        train_stack(cfgs, dirs, progress=False)
    assert untimed(metrics(dirs[0])) == untimed(metrics(stacked[0]))
    assert json.loads((dirs[0] / "summary.json").read_text())["val_loss"] == \
        summaries[0]["val_loss"]
    assert not (dirs[1] / "summary.json").exists()
    assert [r["step"] for r in metrics(dirs[1], "train")] == [1, 2, 3]


def test_a_bf16_stack_trains_as_bf16_lone_runs(tmp_path_factory, tmp_path):
    """Under bf16 autocast (the GPU's precision; here on the CPU) the stacked step runs and
    its first losses are the lone runs' to bf16 rounding."""
    cfgs = member_cfgs(shared_data(tmp_path_factory), **{
        "train.precision": "bf16", "train.max_steps": 2, "train.test_eval": False})
    train_stack(cfgs, [tmp_path / "s0", tmp_path / "s1"], progress=False)
    train(cfgs[1], tmp_path / "lone1", progress=False)
    a, b = metrics(tmp_path / "s1", "train"), metrics(tmp_path / "lone1", "train")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=2e-3)


def test_a_bf16_stack_runs_its_norms_in_fp32(tmp_path_factory, tmp_path, monkeypatch):
    """Autocast's fp32 policy never runs under vmap: the stack widens every norm's input, so
    the nonlinear query's output LayerNorm (fed by a bf16 product) and QK-norm compute in fp32,
    as CUDA autocast computes them for a lone run."""
    import torch

    from nlq.train.stacked import Stack

    seen = []
    init = Stack.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for name, m in self.base.named_modules():
            if isinstance(m, torch.nn.LayerNorm) or type(m).__name__ == "RMSNorm":
                m.register_forward_hook(lambda mod, a, out, n=name: seen.append((n, out.dtype)))

    monkeypatch.setattr(Stack, "__init__", spy)
    cfgs = member_cfgs(shared_data(tmp_path_factory), **{
        "train.precision": "bf16", "train.max_steps": 1, "train.test_eval": False,
        "train.eval_interval": 10})
    train_stack(cfgs, [tmp_path / "s0", tmp_path / "s1"], progress=False)
    names = {n for n, _ in seen}
    assert any(n.endswith("q.out_norm") for n in names) and "ln_f" in names
    assert {dt for _, dt in seen} == {torch.float32}


@pytest.mark.parametrize("key, value, named", [
    ("train.lr", 3e-3, "train.lr"),
    ("model.d_model", 48, "model.d_model"),
])
def test_members_that_differ_beyond_seeds_are_refused(tmp_path_factory, tmp_path, key, value,
                                                      named):
    data = shared_data(tmp_path_factory)
    a, b = member_cfgs(data)
    b = b.replace(**{key: value})
    with pytest.raises(NlqError, match=named):
        train_stack([a, b], [tmp_path / "a", tmp_path / "b"], progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written


def test_dropout_is_refused(tmp_path_factory, tmp_path):
    cfgs = member_cfgs(shared_data(tmp_path_factory), **{"model.dropout": 0.1})
    with pytest.raises(NlqError, match="model.dropout"):
        train_stack(cfgs, [tmp_path / "a", tmp_path / "b"], progress=False)


def test_cli_trains_several_configs_as_a_stack(tmp_path_factory, tmp_path, capsys):
    cfgs = member_cfgs(shared_data(tmp_path_factory), **{"train.max_steps": 3,
                                                          "train.test_eval": False})
    paths = [write_config(tmp_path / f"c{k}.toml", c) for k, c in enumerate(cfgs)]
    assert nlq_main(["train", *map(str, paths), "--out", str(tmp_path / "x"),
                     "--no-progress"]) != 0
    assert "give one per config" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    outs = [tmp_path / "r0", tmp_path / "r1"]
    assert nlq_main(["train", *map(str, paths), "--out", *map(str, outs),
                     "--no-progress"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()[-2:]]
    assert [x["step"] for x in lines] == [3, 3] and all(x["stack"] == 2 for x in lines)
    assert nlq_main(["train", "--resume", *map(str, outs), "--no-progress"]) == 0
    # one config, stacked: the recipe of a stacked rung for a seed left on its own
    capsys.readouterr()
    assert nlq_main(["train", str(paths[0]), "--out", str(tmp_path / "one"), "--stacked",
                     "--no-progress"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["stack"] == 1 and one["val_loss"] == lines[0]["val_loss"]


@pytest.mark.slow
def test_a_signal_stops_the_stack_at_one_boundary(tmp_path_factory, tmp_path):
    """SIGTERM to a stacked `nlq train`: every member checkpoints at the same step and says
    so; `nlq train --resume A B` then ends where the uninterrupted stack ended, bitwise."""
    import os
    import signal

    from helpers import kill_group, n_rows, nlq_cmd, ok, popen_group, wait_for

    data = shared_data(tmp_path_factory)
    cfgs = [tiny_config(data, **{"model.d_model": 64, "model.n_layer": 2, "model.block_size": 32,
                                 "train.micro_batch": 8, "train.max_steps": 300,
                                 "train.ckpt_interval": 100, "train.eval_interval": 100,
                                 "train.seed": 3 + k, "data.seed": 7 + k})
            for k in range(2)]
    paths = [str(write_config(tmp_path / f"c{k}.toml", c)) for k, c in enumerate(cfgs)]
    ref = [tmp_path / "ref0", tmp_path / "ref1"]
    train_stack(cfgs, ref, progress=False)
    runs = [tmp_path / "r0", tmp_path / "r1"]
    proc = popen_group(nlq_cmd("train", *paths, "--out", *runs, "--no-progress"))
    try:
        wait_for(lambda: n_rows(runs[1], "train") >= 5, what="training to start")
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, err
    steps = {json.loads(x)["step"] for x in out.strip().splitlines()[-2:]}
    assert len(steps) == 1 and 5 <= (k := steps.pop()) < 300
    assert f"stopped by signal {int(signal.SIGTERM)} at step {k}" in err
    for r in runs:
        assert (r / "ckpt" / "latest").read_text().strip() == f"step_{k:06d}"
    ok(helpers.nlq("train", "--resume", *runs, "--no-progress"))
    for r, d in zip(runs, ref):
        assert untimed(metrics(r)) == untimed(metrics(d))
        assert_same_final(r, d)


def test_every_study_arm_trains_stacked_as_alone(tmp_path_factory, tmp_path):
    """Each arm of the study's experiment (QK-norm, a normalised linear query, f without its
    LayerNorm, a wider MLP) runs under vmap: 3 stacked steps of two seeds give the lone
    runs' losses."""
    from nlq.experiments.experiment import experiment_arms, load_experiment

    data = shared_data(tmp_path_factory)
    tiny = tiny_config(data)
    sets = {"model.vocab_size": tiny.model.vocab_size, "model.block_size": 16,
            "model.n_layer": 1, "model.n_head": 2, "model.d_model": 32, "model.mlp_hidden": 64,
            "train.micro_batch": 4, "train.grad_accum": 1, "train.max_steps": 3,
            "train.warmup_steps": 1, "train.eval_interval": 3, "train.eval_batches": 1,
            "train.test_eval": False, "train.device": "cpu", "data.dir": str(data),
            "model.dropout": 0.0}
    exp = load_experiment("strong-baseline")
    for arm, cfg in experiment_arms(exp, "tiny", sets).items():
        cfgs = [cfg.replace(**{"train.seed": k, "data.seed": 7 + k}) for k in range(2)]
        dirs = [tmp_path / arm / f"s{k}" for k in range(2)]
        train_stack(cfgs, dirs, progress=False)
        lone = train(cfgs[1], tmp_path / arm / "lone1", progress=False)
        a, b = metrics(dirs[1], "train"), metrics(tmp_path / arm / "lone1", "train")
        assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-4), arm
        assert json.loads((dirs[1] / "summary.json").read_text())["val_loss"] == \
            pytest.approx(lone["val_loss"], rel=1e-4), arm


def test_a_masked_lm_stack_trains_as_its_lone_runs(tmp_path_factory, tmp_path):
    """A masked LM's micro-batches hold different numbers of targets: each member weighs
    them by its own counts, as a lone run does (nlq/train/loop.py, mlm_weights)."""
    data = shared_data(tmp_path_factory)
    mlm = {"model.arch": "encoder", "train.objective": "mlm", "train.mlm_prob": 0.15,
           "train.test_eval": False, "model.query": "linear"}
    cfgs = member_cfgs(data, **mlm)
    stacked = [tmp_path / "stack" / f"seed{k}" for k in range(2)]
    summaries = train_stack(cfgs, stacked, progress=False)
    for k, (c, s_dir, s) in enumerate(zip(cfgs, stacked, summaries)):
        a = train(c, tmp_path / f"alone{k}", progress=False)
        for rs, ra in zip(metrics(s_dir, "train"), metrics(tmp_path / f"alone{k}", "train")):
            assert rs["loss"] == pytest.approx(ra["loss"], rel=1e-4)
        assert s["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4)
