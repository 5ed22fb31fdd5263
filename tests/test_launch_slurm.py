"""--launcher slurm (nlq/experiments/slurm.py): each run a job submitted through submitit.

On this machine the jobs go through submitit's local executor (`executor = "local"` in the
[slurm] table): the same pickled job, the same `nlq train` child, the same signals, minus
the cluster. Their numbers are those of --launcher local, bitwise; a second command trains
nothing; a bad launcher, table or key is one `nlq: error:` line with nothing written. The
Slurm side (sbatch script, scancel, sacct states) runs against stand-in sbatch / scancel /
sacct scripts. Slow tier: a study through it, a SIGTERM that stops and continues, and a
preemption (submitit's SIGUSR2): the run checkpoints, its job is requeued and resumes."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import (
    assert_user_error,
    children_of,
    kill_group,
    last_step,
    make_data,
    nlq,
    nlq_cmd,
    ok,
    snapshot,
    stoppable_experiment,
    wait_for,
)
from test_reproduce import SETS as MINI_SETS
from test_reproduce import mini_setting

from nlq.errors import NlqError
from nlq.experiments import launch, slurm, slurm_settings
from nlq.experiments.runner import failure_cause

submitit = pytest.importorskip("submitit")
cloudpickle = pytest.importorskip("cloudpickle")  # submitit's dependency

LOCAL_TABLE = '[slurm]\nexecutor = "local"\n'


def reproduce(tmp, out, *extra, **env):
    exp, sets = mini_setting(tmp)
    return nlq("reproduce", "--experiment", exp, "--seeds", "2", "--out", out, "--jobs", "2",
               *sets, *extra, timeout=600, **env)


def slurm_args(tmp, table: str = LOCAL_TABLE, name: str = "cluster.toml") -> list[str]:
    (tmp / name).write_text(table)
    return ["--launcher", "slurm", "--slurm", str(tmp / name)]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The mini experiment (2 arms x 2 seeds) through --launcher local and through slurm."""
    tmp = tmp_path_factory.mktemp("slurm")
    ok(reproduce(tmp, tmp / "local"))
    ok(reproduce(tmp, tmp / "slurm", *slurm_args(tmp)))
    return tmp


RUNS = [f"runs/{arm}/seed{k}" for arm in ("linear", "nonlinear") for k in (0, 1)]


def test_slurm_jobs_give_the_numbers_of_local_runs(compared):
    for run in RUNS:
        a, b = (json.loads((compared / d / run / "summary.json").read_text())
                for d in ("local", "slurm"))
        assert (a["step"], a["val_loss"], a["test_loss"]) == (b["step"], b["val_loss"],
                                                              b["test_loss"])
        # the job's `nlq train` wrote the run's train.log, as a local child does
        log = (compared / "slurm" / run / "train.log").read_text()
        assert json.loads(log.strip().splitlines()[-1])["status"] == "finished"
    a, b = (json.loads((compared / d / "report.json").read_text()) for d in ("local", "slurm"))
    assert a == b
    # one submitit job per run, its files under OUT/slurm (the table names no folder)
    assert len(list((compared / "slurm" / "slurm").glob("*_result.pkl"))) == len(RUNS)


def test_a_second_command_submits_nothing(compared):
    out = compared / "slurm"
    before = snapshot(out / "runs"), snapshot(out / "slurm")
    p = ok(reproduce(compared, out, *slurm_args(compared)))
    assert "all 4 runs finished already" in p.stderr
    assert (snapshot(out / "runs"), snapshot(out / "slurm")) == before


@pytest.mark.parametrize("case", ["unknown-launcher", "no-file", "unknown-key",
                                  "missing-key", "file-without-slurm"])
def test_a_bad_launcher_or_table_is_one_error_before_any_write(case, tmp_path):
    args = {
        "unknown-launcher": lambda: ["--launcher", "pbs"],
        "no-file": lambda: ["--launcher", "slurm"],
        "unknown-key": lambda: slurm_args(tmp_path, '[slurm]\npartiton = "gpu"\n'
                                                    'timeout_min = 60\n'),
        "missing-key": lambda: slurm_args(tmp_path, "[slurm]\ntimeout_min = 60\n"),
        "file-without-slurm": lambda: slurm_args(tmp_path)[2:],
    }[case]()
    named = {
        "unknown-launcher": ["--launcher", "pbs", "slurm"],
        "no-file": ["--launcher slurm", "--slurm FILE"],
        "unknown-key": ["'partiton'", "partition, timeout_min"],
        "missing-key": ["'partition'", 'executor = "slurm"'],
        "file-without-slurm": ["--slurm", "--launcher slurm"],
    }[case]
    out = tmp_path / "out"
    p = reproduce(tmp_path, out, *args)
    assert_user_error(p, *named)
    assert not out.exists()


def test_study_checks_its_launcher_before_any_write(tmp_path):
    out = tmp_path / "study"
    p = nlq("study", "--out", out, "--launcher", "slurm", "--slurm", tmp_path / "none.toml")
    assert_user_error(p, "none.toml", "no such file")
    assert not out.exists()


# -- the [slurm] table, in process -----------------------------------------------------


def settings(tmp_path, table: str, out: Path | None = None):
    (tmp_path / "s.toml").write_text(table)
    return slurm_settings.slurm_settings(tmp_path / "s.toml", out or tmp_path / "out")


@pytest.mark.parametrize("table,named", [
    ("partition = 'gpu'\n", "no [slurm] table"),
    ("[slurm]\nexecutor = 'local'\n[other]\n", "'other'"),
    ("[slurm]\nexecutor = 'pbs'\n", "executor must be"),
    ("[slurm]\npartition = 'gpu'\n", "needs 'timeout_min'"),
    ("[slurm]\nexecutor = 'local'\ntimeout_min = 0\n", "timeout_min must be a whole number >= 1"),
    ("[slurm]\nexecutor = 'local'\ntimeout_min = 1.5\n", "timeout_min must be"),
    ("[slurm]\nexecutor = 'local'\nmem_gb = -4\n", "mem_gb must be"),
    ("[slurm]\nexecutor = 'local'\nsetup = 'module load cuda'\n", "setup must be a list"),
    ("[slurm]\nexecutor = 'local'\npartition = ''\n", "partition must be a non-empty"),
    ("[slurm]\nexecutor = 'local'\nadditional_parameters = 3\n", "additional_parameters"),
    ("[slurm\n", "not valid TOML"),
])
def test_every_key_of_the_table_is_checked(tmp_path, table, named):
    with pytest.raises(NlqError, match=None) as e:
        settings(tmp_path, table)
    assert named in str(e.value) and "s.toml" in str(e.value)


def test_table_defaults_and_what_it_sets(tmp_path):
    out = tmp_path / "out"
    s = settings(tmp_path, LOCAL_TABLE, out)
    assert (s.executor, s.folder, s.jobs) == ("local", out / "slurm", 256)
    assert s.submitit_parameters() == {"timeout_min": slurm_settings.LOCAL_TIMEOUT_MIN}
    s = settings(tmp_path, "[slurm]\npartition = 'gpu'\ntimeout_min = 240\n"
                           "array_parallelism = 8\nfolder = '/abs/logs'\nsetup = ['a']\n", out)
    assert (s.executor, s.folder, s.jobs) == ("slurm", Path("/abs/logs"), 8)
    assert s.submitit_parameters() == {"slurm_partition": "gpu", "timeout_min": 240,
                                       "slurm_setup": ["a"]}
    s = settings(tmp_path, LOCAL_TABLE + "folder = 'logs'\nsetup = ['module load x']\n", out)
    assert s.folder == out / "logs"  # relative: to OUT
    # setup is for the cluster's nodes: the local executor runs in this environment
    assert s.submitit_parameters() == {"timeout_min": slurm_settings.LOCAL_TIMEOUT_MIN}


def test_train_run_resumes_a_run_that_exists_and_pickles_without_its_child(tmp_path):
    run = tmp_path / "runs" / "linear" / "seed0"
    run.mkdir(parents=True)
    task = slurm.TrainRun(["train", "c.toml", "--out", str(run)], str(run), str(tmp_path), 2)
    assert task.command() == ["train", "c.toml", "--out", str(run)]
    (run / "config.toml").write_text("")  # a requeued job finds the run it started
    assert task.command() == ["train", "--resume", str(run)]
    task._child = subprocess.Popen(["true"])
    task._child.wait()
    back = pickle.loads(cloudpickle.dumps(task))
    assert back._child is None and back.cmd == task.cmd and back.threads == 2


# -- the Slurm side, against stand-in sbatch / scancel / sacct ---------------------------

FAKE_SBATCH = """#!/bin/sh
cp "$1" "$FAKE/script.sh"
if [ -f "$FAKE/refuse" ]; then
  echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2
  exit 1
fi
echo "Submitted batch job $(cat "$FAKE/id")"
"""
FAKE_SCANCEL = '#!/bin/sh\necho "$@" >> "$FAKE/scancel.log"\n'
FAKE_SACCT = '#!/bin/sh\nprintf "JobID|State|NodeList\\n%s|%s|node1\\n" "$(cat "$FAKE/id")" ' \
             '"$(cat "$FAKE/state")"\n'

TABLE = """[slurm]
partition = "gpu"
timeout_min = 240
gpus_per_node = 1
mem_gb = 16
account = "proj"
qos = "normal"
constraint = "a100"
signal_delay_s = 120
setup = ["module load cuda", "export NCCL_DEBUG=WARN"]
additional_parameters = { mail-type = "END" }
"""


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """Stand-in Slurm commands on PATH; returns (the Slurm launcher, the folder they use,
    set(job id, state))."""
    fake = tmp_path / "fake"
    fake.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("scancel", FAKE_SCANCEL),
                       ("sacct", FAKE_SACCT), ("srun", "#!/bin/sh\n")):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE", str(fake))
    monkeypatch.setattr(slurm.SubmititProc, "_last_forced", 0.0)

    def set_job(job_id: str, state: str) -> None:
        (fake / "id").write_text(job_id)
        (fake / "state").write_text(state)

    set_job(f"9{os.getpid() % 10000}{time.monotonic_ns() % 100000}", "PENDING")
    s = settings(tmp_path, TABLE, tmp_path / "out")
    return launch.make_launcher(s, 2, 1), fake, set_job


def start(launcher, tmp_path, threads=2):
    run = tmp_path / "out" / "runs" / "linear" / "seed0"
    run.mkdir(parents=True, exist_ok=True)
    key = SimpleNamespace(arm="linear", run_dir=run)
    cmd = ["train", str(tmp_path / "c.toml"), "--out", str(run)]
    return launcher.start(key, cmd, None, threads, []), run


def test_sbatch_script_holds_the_table_and_the_job_runs_nlq_train(cluster, tmp_path):
    launcher, fake, _ = cluster
    job, run = start(launcher, tmp_path)
    script = (fake / "script.sh").read_text()
    for line in ("--partition=gpu", "--time=240", "--gpus-per-node=1", "--mem=16GB",
                 "--account=proj", "--qos=normal", "--constraint=a100", "--signal=USR2@120",
                 "--mail-type=END", "--cpus-per-task=2", "--job-name=nlq-linear-seed0"):
        assert f"#SBATCH {line}" in script, line
    assert "module load cuda\nexport NCCL_DEBUG=WARN\n" in script
    assert "srun" in script and "submitit.core._submit" in script
    pkl = next((tmp_path / "out" / "slurm").glob("*_submitted.pkl"))
    task = submitit.core.utils.DelayedSubmission.load(pkl).function
    assert isinstance(task, slurm.TrainRun)
    assert (task.cmd, task.threads, Path(task.run_dir)) == (
        ["train", str(tmp_path / "c.toml"), "--out", str(run)], 2, run)
    assert job.proc.poll() is None  # PENDING


def test_stopping_cancels_a_queued_job_and_signals_a_running_one(cluster, tmp_path):
    launcher, fake, set_job = cluster
    job, _ = start(launcher, tmp_path)
    job_id = (fake / "id").read_text()
    set_job(job_id, "RUNNING")
    job.proc.send_signal(signal.SIGTERM)
    assert (fake / "scancel.log").read_text().splitlines() == [
        f"--state=PENDING {job_id}", f"--signal=TERM {job_id}"]
    set_job(job_id, "CANCELLED by 1000")
    wait_for(lambda: job.proc.poll() is not None, timeout=30, what="the cancelled job")
    assert job.proc.returncode == -signal.SIGTERM  # the runner counts it as stopped


@pytest.mark.parametrize("state,cause", [
    ("TIMEOUT", "exit 1: nlq: error: its slurm job ended (TIMEOUT) before `nlq train` did"),
    ("OUT_OF_MEMORY", "killed by signal 9 SIGKILL (the out-of-memory killer sends it)"),
])
def test_a_job_that_ended_without_a_result_is_a_failed_run_with_its_cause(
        cluster, tmp_path, state, cause):
    launcher, fake, set_job = cluster
    job, run = start(launcher, tmp_path)
    job.proc.job._results_timeout_s = 0  # submitit waits 15 s for a late result file
    set_job((fake / "id").read_text(), state)
    wait_for(lambda: job.proc.poll() is not None, timeout=30, what="the ended job")
    assert failure_cause(job.proc.returncode, run / "train.log").startswith(cause)


def test_a_refused_submission_is_a_failed_run_naming_why(cluster, tmp_path):
    launcher, fake, _ = cluster
    (fake / "refuse").write_text("")
    job, run = start(launcher, tmp_path)
    assert job.proc.poll() == 1
    assert failure_cause(1, run / "train.log") == (
        "exit 1: nlq: error: submitting its job failed: sbatch: error: Batch job submission "
        "failed: Invalid partition name specified")


def test_slurm_without_sbatch_or_submitit_is_one_error(tmp_path, monkeypatch):
    s = settings(tmp_path, "[slurm]\npartition = 'gpu'\ntimeout_min = 60\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    with pytest.raises(NlqError, match="no `sbatch` here"):
        launch.make_launcher(s, 1, 1)
    monkeypatch.setitem(sys.modules, "submitit", None)  # not installed
    with pytest.raises(NlqError, match=r"needs the package 'submitit'.*nlq\[slurm\]"):
        launch.make_launcher(s, 1, 1)


# -- slow: a study, a stop, a preemption --------------------------------------------------


@pytest.mark.slow
def test_a_study_through_slurm_gives_the_study_of_local_runs(tmp_path):
    from test_study import study, toy_ladder

    ladder = toy_ladder(tmp_path)
    ok(study(ladder, tmp_path / "local", "--rungs", "A"))
    ok(study(ladder, tmp_path / "slurm", "--rungs", "A", *slurm_args(tmp_path)))

    def numbers(d):
        rep = json.loads((d / "study.json").read_text())
        rep.pop("machine")
        for r in rep["rungs"]:  # the seconds a run took differ (B: not run, no cost)
            r.get("cost", {}).pop("run_seconds", None)
        return rep

    a = numbers(tmp_path / "local")
    assert a == numbers(tmp_path / "slurm")
    assert a["rungs"][0]["status"] == "done"


# runs long enough to be stopped part way (eval only at the end)
LONG, LONG_SETS = stoppable_experiment(MINI_SETS, max_steps=200, eval_interval=1000)


@pytest.fixture(scope="module")
def long_setting(tmp_path_factory):
    """The LONG experiment's command, and its uninterrupted numbers through --launcher
    local."""
    tmp = tmp_path_factory.mktemp("long")
    make_data(tmp / "data")
    (tmp / "long.toml").write_text(LONG)
    sets = [a for s in LONG_SETS + [f'data.dir="{tmp / "data"}"'] for a in ("--set", s)]
    args = ["reproduce", "--experiment", str(tmp / "long.toml"), "--seeds", "2", *sets]
    ok(nlq(*args, "--jobs", "2", "--out", tmp / "ref", timeout=600))
    return tmp, args


def same_as_reference(tmp, out):
    for run in RUNS:
        a, b = (json.loads((d / run / "summary.json").read_text()) for d in (tmp / "ref", out))
        assert (a["step"], a["val_loss"], a["test_loss"]) == (b["step"], b["val_loss"],
                                                              b["test_loss"])


def popen(args):
    return subprocess.Popen(nlq_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            start_new_session=True)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_a_stopped_command_stops_every_job_and_the_rerun_continues_exactly(long_setting,
                                                                          how):
    """SIGTERM to the command (the runner passes it to each job: submitit's controller
    forwards it, the job to its `nlq train`), or Ctrl-C (SIGINT to the whole process
    group): the running runs checkpoint and stop, no process is left, the command exits
    128 + the signal, and the same command finishes with the uninterrupted numbers."""
    tmp, args = long_setting
    out = tmp / f"out-{how}"
    cmd = [*args, "--jobs", "2", "--out", out, *slurm_args(tmp)]
    runs = [out / r for r in RUNS]
    p = popen(cmd)
    try:
        wait_for(lambda: sum(last_step(r) >= 6 for r in runs) >= 2 or p.poll() is not None,
                 timeout=300, what="two runs under way")
        assert p.poll() is None and len(children_of(out)) == 2
        sig = signal.SIGTERM if how == "sigterm" else signal.SIGINT
        if how == "sigterm":
            p.send_signal(sig)
        else:
            os.killpg(p.pid, sig)
        _, err = p.communicate(timeout=300)
    finally:
        kill_group(p)  # nothing left behind by a failure (the jobs are in its group)
    assert p.returncode == 128 + sig, err
    assert f"stopped by signal {int(sig)}" in err and "Traceback" not in err
    assert children_of(out) == [] and children_of(out, "submitit") == []
    assert not any((r / "summary.json").exists() for r in runs)
    assert sum(any((r / "ckpt").glob("step_*")) for r in runs) == 2
    ok(nlq(*cmd, timeout=600))
    same_as_reference(tmp, out)


@pytest.mark.slow
def test_a_preempted_job_checkpoints_is_requeued_and_resumes_exactly(long_setting):
    """submitit's preemption / time-limit signal (SIGUSR2) to a running job (and, as Slurm
    sends it to every process of the job, to its `nlq train`, which ignores it): the run
    checkpoints and stops, submitit requeues the job, which resumes the run; the command
    ends as if nothing happened."""
    tmp, args = long_setting
    out = tmp / "out-preempted"
    cmd = [*args, "--jobs", "1", "--out", out, *slurm_args(tmp)]
    runs = [out / r for r in RUNS]
    p = popen(cmd)
    try:
        wait_for(lambda: any(last_step(r) >= 6 for r in runs) or p.poll() is not None,
                 timeout=300, what="a run under way")
        [child] = children_of(out)
        os.kill(child, signal.SIGSTOP)  # held where it is while the signals arrive
        run = next(r for r in runs if last_step(r) >= 6)
        assert not (run / "summary.json").exists()
        [task] = children_of(out, "submitit.core._submit")
        os.kill(child, signal.SIGUSR2)
        os.kill(task, signal.SIGUSR2)
        time.sleep(1)  # the job's handler has sent SIGTERM to the run
        os.kill(child, signal.SIGCONT)
        _, err = p.communicate(timeout=300)
    finally:
        kill_group(p)
    assert p.returncode == 0, err
    log = (run / "train.log").read_text()
    assert "stopped by signal 15 at step" in log  # by the job, not killed by SIGUSR2
    assert any("Requeued job" in f.read_text() for f in (out / "slurm").glob("*_log.*"))
    same_as_reference(tmp, out)
