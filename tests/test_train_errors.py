"""What a user can get wrong with `nlq train`, each through a real subprocess: exit != 0, the
last stderr line is `nlq: error: ...` naming the culprit, no traceback, and the files that
were there before are byte for byte unchanged. Plus the recoveries: a corrupted newest
checkpoint falls back to the previous one, a full disk mid-checkpoint keeps the last one.
"""

from __future__ import annotations

import contextlib
import errno
import io
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import helpers
import pytest
import tomli_w
import torch
from helpers import (
    ROOT,
    SHORT,
    assert_same_final,
    assert_user_error,
    ckpt_dirs,
    env,
    kill_group,
    load_ckpt,
    make_data,
    metrics,
    n_rows,
    nlq_cmd,
    popen_group,
    reference_run,
    shared_data,
    snapshot,
    tiny_config,
    wait_for,
    write_config,
)

from nlq.cli import main as nlq_main
from nlq.errors import NlqError
from nlq.run import checkpoint
from nlq.train.loop import train

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

one_thread = helpers.one_thread  # autouse: tiny models run ~10x faster on one thread


@dataclass
class Case:
    args: list
    names: tuple = ()  # what the error line must name
    unchanged: Path | None = None  # a dir whose files must be byte-identical afterwards
    absent: Path | None = None  # a path the failed command must not create
    before: dict = field(default_factory=dict)


def flip_bytes(path: Path, at: int = -100) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))


def stopped_copy(ref: Path, dst: Path) -> Path:
    """A copy of a finished run that looks killed after its last checkpoint."""
    shutil.copytree(ref, dst)
    (dst / "summary.json").unlink()
    return dst


def build_cases(tmp: Path, data: Path, ref: Path) -> dict[str, Case]:
    cfg = tiny_config(data, **SHORT)
    cfg_path = write_config(tmp / "ok.toml", cfg)
    raw = tomllib.loads(cfg.to_toml())
    cases = {}

    bad = {**raw, "train": {**raw["train"], "lrr": 1e-3}}
    (tmp / "unknown.toml").write_text(tomli_w.dumps(bad))
    cases["unknown key"] = Case(["train", tmp / "unknown.toml", "--out", tmp / "o1"],
                                ("train.lrr",), absent=tmp / "o1")
    cases["ill-typed key"] = Case(["train", cfg_path, "--set", "train.max_steps=1.5",
                                   "--out", tmp / "o2"], ("train.max_steps", "1.5"),
                                  absent=tmp / "o2")
    cases["data dir missing"] = Case(["train", cfg_path, "--set",
                                      f'data.dir="{tmp / "no-such-data"}"', "--out", tmp / "o3"],
                                     ("no-such-data",), absent=tmp / "o3")
    big = make_data(tmp / "big-vocab", n_train=2000, n_val=200, vocab_size=1000)
    cases["data for a larger vocab"] = Case(
        ["train", cfg_path, "--set", f'data.dir="{big}"', "--out", tmp / "o4"],
        ("model.vocab_size", "1000", str(big)), absent=tmp / "o4")
    if not torch.cuda.is_available():
        cases["cuda without cuda"] = Case(["train", cfg_path, "--set", "train.device=cuda",
                                           "--out", tmp / "o5"], ("CUDA", "train.device"),
                                          absent=tmp / "o5")

    other = stopped_copy(ref, tmp / "other-model")
    raw_other = {**raw, "model": {**raw["model"], "d_model": 64}}
    (other / "config.toml").write_text(tomli_w.dumps(raw_other))
    cases["checkpoint of another model"] = Case(
        ["train", "--resume", other], ("changed since checkpoint", "step_000008",
                                       "model.d_model = 32 -> 64"), unchanged=other)

    broken = stopped_copy(ref, tmp / "all-corrupt")
    for i, d in enumerate(sorted((broken / "ckpt").glob("step_*"))):
        if i % 2:
            flip_bytes(d / "model.safetensors")
        else:  # truncated
            p = d / "optim.safetensors"
            p.write_bytes(p.read_bytes()[:-17])
    cases["every checkpoint corrupted"] = Case(
        ["train", "--resume", broken], ("no valid checkpoint", str(broken / "ckpt"),
                                        "sha256"), unchanged=broken)

    unrelated = tmp / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("not a run\n")
    cases["resume an unrelated dir"] = Case(["train", "--resume", unrelated],
                                            ("not an nlq run dir", str(unrelated)),
                                            unchanged=unrelated)
    cases["resume a missing dir"] = Case(["train", "--resume", tmp / "nothing"],
                                         ("nothing",), absent=tmp / "nothing")
    held = stopped_copy(ref, tmp / "held")
    cases["resume plus a config"] = Case(["train", cfg_path, "--resume", held], ("--resume",),
                                         unchanged=held)
    cases["new run over an existing one"] = Case(["train", cfg_path, "--out", held],
                                                 ("already holds a run", str(held)),
                                                 unchanged=held)

    newest_bad = stopped_copy(ref, tmp / "newest-corrupt")
    flip_bytes(newest_bad / "ckpt" / "step_000008" / "model.safetensors")
    cases["newest checkpoint corrupted"] = Case(["train", "--resume", newest_bad])  # recovers
    return cases


def run_inprocess(args) -> subprocess.CompletedProcess:
    """`nlq ARGS` through nlq.cli.main in this process: the CLI's own error path, without the
    interpreter start-up (seconds on a 2-core CI machine)."""
    out, err = io.StringIO(), io.StringIO()
    argv = [str(a) for a in args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = nlq_main(argv)
        except SystemExit as e:  # argparse
            rc = e.code
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


def run_subprocesses(arg_lists: dict[str, list]) -> dict[str, subprocess.CompletedProcess]:
    """`python -m nlq ARGS` for each entry, three at a time (each is mostly start-up)."""
    queue, running, done = list(arg_lists), {}, {}
    while queue or running:
        while queue and len(running) < 3:
            name = queue.pop(0)
            running[name] = subprocess.Popen(nlq_cmd(*arg_lists[name]), cwd=ROOT, env=env(),
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                out, err = proc.communicate()
                done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
                del running[name]
        time.sleep(0.02)
    return done


# The default tier runs every case through nlq.cli.main in process; the slow tier runs the
# same cases as real `python -m nlq` processes.
MODES = ["in-process", pytest.param("subprocess", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=MODES)
def results(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"errors-{request.param}")
    data = shared_data(tmp_path_factory)
    ref = reference_run(tmp_path_factory, tiny_config(data, **SHORT))
    cases = build_cases(tmp, data, ref)
    for c in cases.values():
        c.before = snapshot(c.unchanged) if c.unchanged else {}
    args = {name: [*c.args, "--no-progress"] for name, c in cases.items()}
    if request.param == "subprocess":
        done = run_subprocesses(args)
    else:
        done = {name: run_inprocess(a) for name, a in args.items()}
    return cases, done, ref


ERRORS = ["unknown key", "ill-typed key", "data dir missing", "data for a larger vocab",
          "cuda without cuda", "checkpoint of another model", "every checkpoint corrupted",
          "resume an unrelated dir", "resume a missing dir", "resume plus a config",
          "new run over an existing one"]


@pytest.mark.parametrize("name", ERRORS)
def test_user_error(results, name):
    cases, done, _ = results
    if name not in cases:
        pytest.skip("this machine has CUDA")
    case, p = cases[name], done[name]
    assert p.returncode == 2, p.stderr
    assert_user_error(p, *case.names)
    if case.unchanged is not None:
        assert snapshot(case.unchanged) == case.before
    if case.absent is not None:
        assert not case.absent.exists()


def test_corrupted_newest_checkpoint_falls_back(results):
    cases, done, ref = results
    run, p = cases["newest checkpoint corrupted"].args[-1], done["newest checkpoint corrupted"]
    assert p.returncode == 0, p.stderr
    assert "warning: skipping checkpoint" in p.stderr and "step_000008" in p.stderr
    assert "sha256" in p.stderr
    assert_same_final(ref, run)  # resumed from step 6, bitwise the uninterrupted run


def test_full_disk_during_a_checkpoint(tmp_path_factory, tmp_path, monkeypatch):
    """ENOSPC while writing the 2nd checkpoint: an NlqError naming it; the 1st checkpoint and
    `latest` stay, no temporary dir is left; --resume then ends as an uninterrupted run."""
    data = shared_data(tmp_path_factory)
    cfg = tiny_config(data)  # checkpoints at steps 3 and 6
    calls = []
    real = checkpoint.save_file

    def save_file(tensors, filename, *a, **k):
        calls.append(filename)
        if len(calls) == 4:  # the optimizer file of the 2nd checkpoint
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    run = tmp_path / "run"
    with pytest.raises(NlqError, match="No space left on device") as e:
        train(cfg, run, progress=False)
    assert str(run / "ckpt" / "step_000006") in str(e.value)
    assert ckpt_dirs(run) == ["step_000003"]
    assert (run / "ckpt" / "latest").read_text() == "step_000003\n"
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["latest", "step_000003"]
    assert checkpoint.load_latest(run).state["step"] == 3
    assert not (run / "summary.json").exists()

    monkeypatch.setattr(checkpoint, "save_file", real)
    train(cfg, run, resume=True, progress=False)
    train(cfg, tmp_path / "uninterrupted", progress=False)
    assert_same_final(tmp_path / "uninterrupted", run)
    assert metrics(run, "train") and metrics(run, "train")[-1]["step"] == 6


@pytest.mark.parametrize("mode", MODES)
def test_second_process_on_a_run_dir_is_refused(tmp_path_factory, tmp_path, mode):
    """While one `nlq train` process runs, a second one on its dir (a new run or --resume;
    this test process itself, or two more subprocesses) fails fast naming the lock; the
    first is then stopped cleanly by SIGTERM."""
    data = shared_data(tmp_path_factory)
    cfg = tiny_config(data, **{"train.max_steps": 1_000_000, "train.ckpt_interval": 1000,
                               "train.eval_interval": 1000, "train.log_interval": 1})
    cfg_path = write_config(tmp_path / "c.toml", cfg)
    run = tmp_path / "run"
    first = popen_group(nlq_cmd("train", cfg_path, "--out", run, "--no-progress"))
    try:
        wait_for(lambda: n_rows(run, "train") > 0, what="the first run to train")
        args = {"new": ["train", cfg_path, "--out", run, "--no-progress"],
                "resume": ["train", "--resume", run, "--no-progress"]}
        done = (run_subprocesses(args) if mode == "subprocess"
                else {k: run_inprocess(a) for k, a in args.items()})
        for p in done.values():
            assert p.returncode == 2, p.stderr
            assert_user_error(p, "another `nlq train` is running", str(run / ".lock"))
        assert first.poll() is None, "the first run stopped"
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        kill_group(first)
    assert first.returncode == 0, err
    assert "stopped by signal" in err
    assert not (run / "summary.json").exists()
    assert load_ckpt(run)[0]
