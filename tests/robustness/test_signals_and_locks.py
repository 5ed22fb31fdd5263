"""Robustness: signals, divergence, two processes on one run dir, and nothing executed or
unpickled that a user passes.

- SIGINT / SIGTERM: the step in progress finishes, a checkpoint is written at that step
  boundary, the process exits 0; --resume then ends bitwise equal to the uninterrupted run.
  Once from outside a running process, once exactly mid-step (in process, during the
  second micro-step's forward).
- NaN / inf: the run stops naming the step, the last good checkpoint stays byte-identical,
  no summary.json is written.
- Two `nlq train` on one run dir: the second (new run or --resume) refuses naming the lock
  and writes nothing; the first ends exactly as if alone.
- Security: an AST scan of the package (extends the line scan of tests/test_package.py) and
  payloads in configs, checkpoints and data that would leave a marker file if executed.

The slow tier of tests/test_resume.py runs the outside-signal and divergence-resume cases
as `python -m nlq` subprocesses; here they run as zygote children (conftest.py).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import helpers
import pytest
import torch
from conftest import reference
from helpers import (
    SHORT,
    assert_same_final,
    assert_user_error,
    final_ckpt,
    freeze,
    interrupted_step,
    metrics,
    n_rows,
    ok,
    snapshot,
    stopped_at_6,
    tiny_config,
    untimed,
    wait_for,
    write_config,
)

from nlq.cli import main as nlq_main
from nlq.model import Transformer

one_thread = helpers.one_thread  # autouse: in-process runs and comparisons on one thread

# long enough (~1 s) to be signalled while it runs
LONG = {"train.max_steps": 150, "train.ckpt_interval": 50, "train.eval_interval": 50,
        "train.log_interval": 1, "model.dropout": 0.1}
SIGNALS = pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM],
                                  ids=["SIGINT", "SIGTERM"])


@pytest.fixture(scope="module")
def long(data, zygote, tmp_path_factory):
    cfg = tiny_config(data, **LONG)
    return cfg, reference(zygote, tmp_path_factory, cfg)


@pytest.fixture(scope="module")
def short(data, zygote, tmp_path_factory):
    cfg = tiny_config(data, **SHORT)
    return cfg, reference(zygote, tmp_path_factory, cfg)


def summary(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    return {k: v for k, v in s.items() if k not in ("elapsed_s", "tok_per_s")}


def assert_same_run(ref: Path, run: Path) -> None:
    assert_same_final(ref, run)
    assert untimed(metrics(run)) == untimed(metrics(ref))
    assert summary(run) == summary(ref)


def assert_stopped_at(run: Path, k: int, sig: int, err: str) -> None:
    assert f"stopped by signal {int(sig)} at step {k}" in err, err
    assert final_ckpt(run).name == f"step_{k:06d}"
    assert json.loads((final_ckpt(run) / "state.json").read_text())["step"] == k
    assert metrics(run, "train")[-1]["step"] == k
    assert not (run / "summary.json").exists()


def cli(*args) -> tuple[int, str, str]:
    """`nlq ARGS` through nlq.cli.main in this process: (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = nlq_main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


# -- SIGINT / SIGTERM ------------------------------------------------------------------------


@SIGNALS
def test_signal_from_outside_stops_at_a_step_boundary(sig, long, tmp_path, zygote):
    cfg, ref = long
    run = tmp_path / "run"
    proc = zygote.start("train", write_config(tmp_path / "c.toml", cfg), "--out", run,
                        "--no-progress")
    wait_for(lambda: n_rows(run, "train") >= 5 or proc.poll() is not None, what="5 steps")
    proc.send_signal(sig)
    p = proc.wait()
    k = interrupted_step(p.returncode, p.stdout, p.stderr, sig)
    assert 5 <= k < cfg.train.max_steps
    assert_stopped_at(run, k, sig, p.stderr)
    print(f"\n{sig.name}: stopped at step {k}, exit 0; resumed to step {cfg.train.max_steps}")
    ok(zygote.run("train", "--resume", run, "--no-progress"))
    assert_same_run(ref, run)


@SIGNALS
def test_signal_mid_step_finishes_the_step(sig, short, tmp_path, monkeypatch):
    """The signal arrives during the forward of the 2nd micro-step of step 5: that step
    completes (its optimizer step included), step_000005 is written, the status is 0."""
    cfg, ref = short
    forward = Transformer.forward
    calls = {"train": 0}

    def signalling_forward(self, *a, **k):
        if self.training:
            calls["train"] += 1
            if calls["train"] == 2 * 4 + 2:  # grad_accum 2: step index 4, micro-step 2
                os.kill(os.getpid(), sig)
        return forward(self, *a, **k)

    monkeypatch.setattr(Transformer, "forward", signalling_forward)
    run = tmp_path / "run"
    rc, out, err = cli("train", write_config(tmp_path / "c.toml", cfg), "--out", run,
                       "--no-progress")
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"status": "interrupted", "step": 5}
    assert_stopped_at(run, 5, sig, err)
    assert calls["train"] == 10  # no forward after the signal's step
    monkeypatch.setattr(Transformer, "forward", forward)
    rc, _, err = cli("train", "--resume", run, "--no-progress")
    assert rc == 0, err
    assert_same_run(ref, run)


# -- NaN / inf -------------------------------------------------------------------------------


def test_nan_before_the_first_checkpoint(short, tmp_path, zygote):
    """NaN at step 1: one line naming step 1, nothing saved, no summary; --resume starts
    the run again and ends as the uninterrupted run."""
    cfg, ref = short
    run = tmp_path / "run"
    p = zygote.run("train", write_config(tmp_path / "c.toml", cfg), "--out", run,
                   "--no-progress", NLQ_FAULT="nan@1")
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert_user_error(p, "diverged at step 1", "loss nan")
    assert not (run / "ckpt").exists() and not (run / "summary.json").exists()
    p = ok(zygote.run("train", "--resume", run, "--no-progress"))
    assert "no checkpoint yet; starting it again from step 0" in p.stderr
    assert_same_run(ref, run)


def test_nan_after_a_resume_keeps_the_checkpoints(short, tmp_path, zygote):
    """A run stopped at step 6 diverges right after resuming: ckpt/ byte-identical, no
    summary; resumed without the fault it ends as the uninterrupted run."""
    _, ref = short
    run = stopped_at_6(ref, tmp_path / "run")
    before = snapshot(run / "ckpt")
    p = zygote.run("train", "--resume", run, "--no-progress", NLQ_FAULT="nan@1")
    assert_user_error(p, "diverged at step 7", str(run / "ckpt"))
    assert snapshot(run / "ckpt") == before
    assert not (run / "summary.json").exists()
    ok(zygote.run("train", "--resume", run, "--no-progress"))
    assert_same_run(ref, run)


def test_inf_grad_norm_keeps_the_last_good_checkpoint(short, tmp_path, monkeypatch):
    """An infinite gradient norm at step 5 (finite loss): status 2, one line naming step 5
    and the norm; step_000004 is byte for byte the uninterrupted run's; nothing later."""
    cfg, ref = short
    real = torch.nn.utils.clip_grad_norm_
    n = {"calls": 0}

    def clip(params, max_norm, *a, **k):
        norm = real(params, max_norm, *a, **k)
        n["calls"] += 1
        return torch.tensor(float("inf")) if n["calls"] == 5 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    run = tmp_path / "run"
    rc, out, err = cli("train", write_config(tmp_path / "c.toml", cfg), "--out", run,
                       "--no-progress")
    assert rc == 2 and all(ln.startswith("step ") for ln in out.splitlines())  # plain log
    assert err.count("\n") == 1 and err.startswith("nlq: error: training diverged at step 5")
    assert "grad norm inf" in err
    assert sorted(d.name for d in (run / "ckpt").glob("step_*")) == ["step_000002",
                                                                     "step_000004"]
    for f in ("model.safetensors", "optim.safetensors"):
        assert (run / "ckpt" / "step_000004" / f).read_bytes() == \
            (ref / "ckpt" / "step_000004" / f).read_bytes()
    assert not (run / "summary.json").exists()


# -- two processes, one run dir ----------------------------------------------------------------


def test_second_process_refused_and_writes_nothing(long, tmp_path, zygote):
    """The first run is frozen (SIGSTOP) while holding its lock, so nothing changes under
    it: a second `nlq train` (new run) and a third (--resume) refuse naming the lock, and
    the run dir is byte-identical afterwards. Thawed, the first ends bitwise as if alone."""
    cfg, ref = long
    cfg_path = write_config(tmp_path / "c.toml", cfg)
    run = tmp_path / "run"
    first = zygote.start("train", cfg_path, "--out", run, "--no-progress")
    try:
        wait_for(lambda: n_rows(run, "train") >= 3 or first.poll() is not None,
                 what="the first run to train")
        freeze(first)
        assert first.poll() is None, "the first run ended too early"
        before = snapshot(run)
        others = [zygote.start("train", cfg_path, "--out", run, "--no-progress"),
                  zygote.start("train", "--resume", run, "--no-progress")]
        for p in (o.wait() for o in others):
            assert p.returncode == 2, p.stderr
            assert_user_error(p, "another `nlq train` is running", str(run / ".lock"))
        assert snapshot(run) == before
    finally:
        first.send_signal(signal.SIGCONT)
    ok(first.wait())
    assert_same_run(ref, run)


# -- security ---------------------------------------------------------------------------------

PKG = Path(__file__).resolve().parents[2] / "nlq"
UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal",
              "shelve", "jsonpickle"}


def dangerous_calls(tree: ast.AST) -> list[str]:
    """Calls that execute or unpickle, found by syntax (a call split over lines, an alias or
    a comment cannot hide one from this, unlike a line regex)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found += [f"import {m}" for m in mods if m and m.split(".")[0] in UNPICKLERS]
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
        kw = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
        if isinstance(f, ast.Name) and name in ("eval", "exec", "compile", "__import__"):
            found.append(f"{name}(")
        elif owner.split(".")[0] in UNPICKLERS and name in ("load", "loads", "open",
                                                            "Unpickler"):
            found.append(f"{owner}.{name}(")
        elif name == "load" and owner == "torch" and kw.get("weights_only") is not True:
            found.append("torch.load( without weights_only=True")
        elif name == "load" and owner in ("np", "numpy") and kw.get("allow_pickle") is True:
            found.append("np.load(allow_pickle=True)")
        elif owner == "yaml" and name in ("load", "unsafe_load", "full_load"):
            found.append(f"yaml.{name}(")
        elif owner == "runpy" or (owner == "torch.jit" and name == "load"):
            found.append(f"{owner}.{name}(")
    return found


def test_scan_catches_what_it_looks_for():
    bad = ("import pickle\npickle.loads(b)\ntorch.load(\n  p)\ntorch.load(p, weights_only=False)\n"
           "np.load(p, allow_pickle=True)\neval('1')\nexec(s)\nyaml.load(s)\n")
    assert len(dangerous_calls(ast.parse(bad))) == 8
    fine = "torch.load(p, weights_only=True)\nnp.load(p)\nx.eval()\nmodel.eval()\njson.loads(s)\n"
    assert dangerous_calls(ast.parse(fine)) == []


def test_package_never_unpickles_or_executes():
    hits = {str(p.relative_to(PKG.parent)): dangerous_calls(ast.parse(p.read_text()))
            for p in sorted(PKG.rglob("*.py"))}
    assert {k: v for k, v in hits.items() if v} == {}
    assert len(hits) > 20  # the whole package was read


def payload(marker: Path) -> bytes:
    """A pickle that, if anything unpickled it, would create `marker`."""

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return pickle.dumps(Payload())


def test_python_in_a_config_is_never_executed(tmp_path, data, zygote):
    marker = tmp_path / "EXECUTED"
    code = f"__import__('os').system('touch {marker}')"
    py = tmp_path / "config.py"
    py.write_text(f"{code}\n[model]\nn_layer = 1\n")
    toml_with_code = write_config(tmp_path / "c.toml", tiny_config(data, **SHORT))
    toml_with_code.write_text(toml_with_code.read_text().replace('device = "cpu"',
                                                                 f'device = "{code}"'))
    exp = tmp_path / "experiment.py"
    exp.write_text(f"{code}\n")
    answers = [
        zygote.run("train", py, "--out", tmp_path / "o1", "--no-progress"),
        zygote.run("train", toml_with_code, "--out", tmp_path / "o2", "--no-progress"),
        zygote.run("train", toml_with_code, "--set", f"train.lr={code}", "--out",
                   tmp_path / "o3", "--no-progress"),
        zygote.run("reproduce", "--experiment", exp, "--out", tmp_path / "o4"),
    ]
    for p, names in zip(answers, [(str(py), "not valid TOML"), ("train.device",),
                                  ("train.lr", "float"), (str(exp), "not valid TOML")]):
        assert p.returncode == 2
        assert_user_error(p, *names)
    assert not marker.exists()


def test_pickles_in_checkpoints_and_data_are_never_unpickled(short, tmp_path, data, zygote):
    """The newest model.safetensors replaced by a pickle whose sha256 is recorded (only the
    loader stands in the way): it is skipped with a warning and the run resumes from the
    older checkpoint, exactly. A train.bin of pickle bytes is read as tokens and refused."""
    cfg, ref = short
    marker = tmp_path / "UNPICKLED"
    blob = payload(marker)
    run = stopped_at_6(ref, tmp_path / "run")
    ck = run / "ckpt" / "step_000006"
    (ck / "model.safetensors").write_bytes(blob)
    st = json.loads((ck / "state.json").read_text())
    st["sha256"]["model.safetensors"] = __import__("hashlib").sha256(blob).hexdigest()
    (ck / "state.json").write_text(json.dumps(st))
    p = ok(zygote.run("train", "--resume", run, "--no-progress"))
    assert f"skipping checkpoint {ck}" in p.stderr
    assert_same_run(ref, run)

    d = tmp_path / "data"
    shutil.copytree(data, d)
    raw = blob + b"\0" * (len(blob) % 2)
    (d / "train.bin").write_bytes(raw * (400 // len(raw) + 1))
    meta = json.loads((d / "meta.json").read_text())
    meta["train_tokens"] = (d / "train.bin").stat().st_size // 2
    (d / "meta.json").write_text(json.dumps(meta))
    p = zygote.run("train", write_config(tmp_path / "c.toml", cfg.replace(**{"data.dir": str(d)})),
                   "--out", tmp_path / "o", "--no-progress")
    assert_user_error(p, str(d / "train.bin"), "vocab_size")
    assert not marker.exists()
