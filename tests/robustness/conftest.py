"""Shared by the robustness suite: `from helpers import ...` works here, and `nlq`
processes start in milliseconds instead of seconds.

Why a zygote: `python -m nlq` spends 2-5 s importing torch on a loaded 2-core CI machine, and
this suite starts about a hundred nlq processes. The zygote is one `python` process that
imports torch and nlq once (and trains one tiny warm-up run, so lazily imported modules are
loaded too), then forks a child per request. Each child is a real process with its own pid,
environment, cwd, stdout and stderr, running `nlq.cli.main(argv)` exactly as `python -m nlq`
does (nlq/__main__.py): an uncaught exception prints a traceback and exits 1, argparse exits
2. It can be SIGKILLed, SIGINTed or SIGTERMed from outside, and NLQ_FAULT kills it from
inside. The slow tier runs the same tests through real `python -m nlq` subprocesses
(`Runner("subprocess")`); the default tier also runs a few real ones (test_bad_inputs.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # `from helpers import ...`

from helpers import PY, ROOT, env, nlq_cmd

# Runs in the zygote process: argv[1] is a warm-up config (TOML) and a scratch dir.
ZYGOTE_SRC = r'''
import json, os, shutil, signal, sys, traceback
# Ctrl-C as in a terminal, whatever this process inherited: a shell's background job (`cmd &`
# without job control, e.g. under nohup) starts with SIGINT ignored, which every forked nlq
# would keep, and a test of Ctrl-C would then see a run that never got it
signal.signal(signal.SIGINT, signal.default_int_handler)
import torch
torch.set_num_threads(1)
from nlq.cli import main
import nlq.data.prepare, nlq.report.report, nlq.experiments.reproduce, nlq.train.loop  # noqa

def warm_up(cfg_path, scratch):
    # one tiny run in this process: what a first training run loads lazily is loaded once
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1); os.dup2(null, 2)
    try:
        main(["train", cfg_path, "--out", os.path.join(scratch, "warm-up"), "--no-progress"])
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        shutil.rmtree(os.path.join(scratch, "warm-up"), ignore_errors=True)

def child(req):
    os.setpgid(0, 0)  # a group of its own: killing it reaches nothing else
    os.environ.clear(); os.environ.update(req["env"])
    os.chdir(req["cwd"])
    fd0 = os.open(os.devnull, os.O_RDONLY)
    fd1 = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fd2 = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd0, 0); os.dup2(fd1, 1); os.dup2(fd2, 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = ["nlq", *req["argv"]]
    try:
        rc = main(req["argv"])  # what nlq/__main__.py does: raise SystemExit(main())
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()  # as the interpreter does for an uncaught exception
        rc = 1
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(int(rc or 0) & 0xFF)

warm_up(sys.argv[1], sys.argv[2])
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "spawn":
        pid = os.fork()
        if pid == 0:
            child(req)
        reply = {"pid": pid}
    else:  # "poll": the exit status of a child, or None while it runs
        done, status = os.waitpid(req["pid"], os.WNOHANG)
        reply = {"rc": os.waitstatus_to_exitcode(status) if done else None}
    print(json.dumps(reply), flush=True)
'''


class Proc:
    """A running nlq process (zygote child or subprocess): pid, poll(), wait(), signal."""

    def __init__(self, runner: Runner, args: list, pid: int, out: Path, err: Path,
                 popen: subprocess.Popen | None = None):
        self.runner, self.args, self.pid = runner, args, pid
        self.out, self.err, self.popen = out, err, popen
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = (self.popen.poll() if self.popen is not None
                               else self.runner._ask({"op": "poll", "pid": self.pid})["rc"])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.send_signal(signal.SIGKILL)
                while self.poll() is None:
                    time.sleep(0.01)
                raise AssertionError(f"nlq {self.args} ran past {timeout}s (killed)")
            time.sleep(0.005)
        return subprocess.CompletedProcess(["nlq", *self.args], self.returncode,
                                           self.out.read_text(), self.err.read_text())


class Runner:
    """Starts `nlq ARGS` processes: forked from the zygote, or `python -m nlq` subprocesses.
    start() returns a Proc; run() waits for it and returns a CompletedProcess (text)."""

    def __init__(self, kind: str, scratch: Path, warm_cfg: Path | None = None):
        self.kind, self.scratch, self.n = kind, scratch, 0
        self.zygote = None
        if kind == "zygote":
            self.zygote = subprocess.Popen(
                [PY, "-c", ZYGOTE_SRC, str(warm_cfg), str(scratch)], cwd=ROOT, env=env(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def _ask(self, req: dict) -> dict:
        self.zygote.stdin.write(json.dumps(req) + "\n")
        self.zygote.stdin.flush()
        line = self.zygote.stdout.readline()
        if not line:
            raise RuntimeError(f"the nlq zygote died (exit {self.zygote.wait()})")
        return json.loads(line)

    def start(self, *args, cwd: Path = ROOT, **env_extra) -> Proc:
        self.n += 1
        out, err = self.scratch / f"{self.n}.out", self.scratch / f"{self.n}.err"
        args = [str(a) for a in args]
        if self.zygote is None:
            with open(out, "w") as fo, open(err, "w") as fe:
                p = subprocess.Popen(nlq_cmd(*args), cwd=cwd, env=env(**env_extra), stdout=fo,
                                     stderr=fe, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
            return Proc(self, args, p.pid, out, err, popen=p)
        pid = self._ask({"op": "spawn", "argv": args, "env": env(**env_extra), "cwd": str(cwd),
                         "out": str(out), "err": str(err)})["pid"]
        return Proc(self, args, pid, out, err)

    def run(self, *args, timeout: float = 300, **env_extra) -> subprocess.CompletedProcess:
        return self.start(*args, **env_extra).wait(timeout)

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.stdin.close()
            try:
                self.zygote.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.zygote.kill()
                self.zygote.wait()


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    from helpers import shared_data

    return shared_data(tmp_path_factory)


@pytest.fixture(scope="session")
def zygote(tmp_path_factory, data) -> Runner:
    """The session's zygote (see the module docstring)."""
    from helpers import tiny_config, write_config

    scratch = tmp_path_factory.mktemp("zygote")
    warm = write_config(scratch / "warm-up.toml", tiny_config(data, **{"train.max_steps": 2,
                                                                       "train.ckpt_interval": 1}))
    r = Runner("zygote", scratch, warm)
    yield r
    r.close()


def subprocess_runner(tmp_path_factory) -> Runner:
    return Runner("subprocess", tmp_path_factory.mktemp("subprocess"))


def reference(runner: Runner, tmp_path_factory, cfg) -> Path:
    """An uninterrupted run of cfg through `runner`, once per session (helpers.reference_run:
    either one reuses the other's run)."""
    from helpers import reference_run

    return reference_run(tmp_path_factory, cfg, train=lambda path, run: runner.run(
        "train", path, "--out", run, "--no-progress"))
