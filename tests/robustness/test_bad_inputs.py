"""Robustness: every mistake a user makes gets an answer they understand, and nothing earlier is
lost. Each bad input below runs as its own `nlq` process (forked from the zygote in the
default tier, `python -m nlq` in the slow tier; see conftest.py) and must end with
- an exit status != 0, or a clean finish (status 0 and a warning) where nlq can recover;
- a last stderr line `nlq: error: ...` naming the file, key or value, and no traceback;
- the files that were there before byte-identical afterwards (helpers.snapshot), and no
  output dir left behind by a command that failed.

Not repeated here (tests/test_train_errors.py proves them): an unknown key in a file
(train.lrr), max_steps = 1.5, a missing data dir, data for a larger vocab, device = cuda
without CUDA, a checkpoint of another d_model, every checkpoint corrupted, --resume on an
unrelated or missing dir, --resume with a config, a new run over an existing one, a
bit-flipped newest checkpoint. Of nlq prepare, tests/test_data_prepare.py checks the
messages in process; here they run as processes with the earlier data dir snapshotted.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import helpers
import numpy as np
import pytest
from conftest import Runner, reference, subprocess_runner
from helpers import (
    SHORT,
    assert_same_final,
    assert_user_error,
    make_data,
    snapshot,
    stopped_at_6,
    tiny_config,
    write_config,
)

one_thread = helpers.one_thread  # autouse: this process compares tensors on one thread


@dataclass
class Case:
    args: list
    names: tuple = ()  # what the last stderr line must name
    unchanged: tuple = ()  # dirs whose files must be byte-identical afterwards
    absent: tuple = ()  # paths the command must not create
    ok: bool = False  # a clean finish (status 0) is the right answer
    warns: tuple = ()  # what stderr must say before a clean finish
    after: Callable | None = None  # more checks of a clean finish
    argparse: bool = False  # argparse's own answer: usage, then `nlq: error: ...`
    before: dict = field(default_factory=dict)


# Every bad input of this file, in the order build_cases makes them (a test checks).
CASES = [
    # the command line
    "unknown flag", "--set without '='", "--set of an unknown section",
    "--set with an empty value", "config path is a directory",
    "config path is a directory named .toml", "unknown preset", "no config at all",
    "nlq params of an unknown preset", "nlq reproduce --arms nosuch",
    "nlq reproduce of an unknown experiment", "nlq reproduce --seeds 1",
    "nlq report on a dir with no runs", "nlq report on unfinished runs only",
    "nlq report with an unknown --baseline", "--resume on a file",
    # configs
    "malformed TOML", "unknown section", "string for an int", "a section that is not a table",
    "train.lr = nan", "train.lr = inf", "train.micro_batch = 0", "train.max_steps = -1",
    "model.d_model not divisible by n_head", "unknown query variant", "non-UTF-8 config",
    "binary file as config", "--resume with a malformed config.toml",
    # data
    "meta.json vocab 70000 in uint16", "model.vocab_size beyond the data's uint16",
    "context longer than the data", "truncated train.bin",
    "meta.json says uint32 for uint16 bins", "meta.json says float16",
    "meta.json without vocab_size", "meta.json not JSON",
    "ids in train.bin beyond meta.json's vocab", "empty val.bin", "data dir is a file",
    # nlq prepare
    "empty corpus", "corpus of blank files", "non-UTF-8 text", "binary file as text",
    "prepare over other data without --force", "prepare --out is a file",
    "unknown tokenizer size", "--val-fraction 1.5", "prepare --workers 0", "hf: without a name",
    # checkpoints
    "checkpoint of another arm", "checkpoint of another shape",
    "truncated newest model.safetensors", "missing latest pointer",
    "latest names a missing checkpoint", "newest state.json lacks keys",
    "newest state.json not JSON", "--out under a file",
]


def edit_meta(d: Path, **changes) -> Path:
    meta = json.loads((d / "meta.json").read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def build_cases(tmp: Path, data: Path, ref: Path, nl: Path) -> dict[str, Case]:
    cfg = tiny_config(data, **SHORT)
    okc = write_config(tmp / "ok.toml", cfg)
    text = okc.read_text()
    def out(name: str) -> Path:  # where a failed command must write nothing
        return tmp / "out" / name

    (tmp / "out").mkdir()
    c: dict[str, Case] = {}

    def train(name: str, *args, names=(), **kw):
        c[name] = Case(["train", *args, "--out", out(name), "--no-progress"], names,
                       absent=(out(name),), **kw)

    def cfg_file(name: str, body: str | bytes) -> Path:
        p = tmp / name
        p.write_bytes(body if isinstance(body, bytes) else body.encode())
        return p

    # -- the command line -----------------------------------------------------------------
    train("unknown flag", okc, "--bogus", names=("--bogus",), argparse=True)
    train("--set without '='", okc, "--set", "train.lr", names=("train.lr", "section.key=value"))
    train("--set of an unknown section", okc, "--set", "optim.lr=1", names=("optim.lr",))
    train("--set with an empty value", okc, "--set", "train.lr=", names=("train.lr", "float"))
    (tmp / "a-dir").mkdir()
    train("config path is a directory", tmp / "a-dir", names=(str(tmp / "a-dir"), "directory"))
    (tmp / "dir.toml").mkdir()
    train("config path is a directory named .toml", tmp / "dir.toml",
          names=(str(tmp / "dir.toml"), "directory"))
    train("unknown preset", "nosuchpreset", names=("nosuchpreset", "presets"))
    c["no config at all"] = Case(["train"], ("config", "--resume"))
    c["nlq params of an unknown preset"] = Case(["params", "--preset", "nosuch"], ("nosuch",))
    c["nlq reproduce --arms nosuch"] = Case(
        ["reproduce", "--arms", "nosuch", "--out", out("rep-arms")], ("nosuch", "--arms"),
        absent=(out("rep-arms"),))
    c["nlq reproduce of an unknown experiment"] = Case(
        ["reproduce", "--experiment", "nosuchexp", "--out", out("rep-exp")], ("nosuchexp",),
        absent=(out("rep-exp"),))
    c["nlq reproduce --seeds 1"] = Case(["reproduce", "--seeds", "1", "--out", out("rep-1")],
                                        ("--seeds", ">= 2", "got 1"), absent=(out("rep-1"),))
    (tmp / "no-runs").mkdir()
    c["nlq report on a dir with no runs"] = Case(
        ["report", tmp / "no-runs", "--out", out("report-none")], (str(tmp / "no-runs"),),
        absent=(out("report-none"),))
    stopped = stopped_at_6(ref, tmp / "stopped-for-report")
    c["nlq report on unfinished runs only"] = Case(
        ["report", stopped, "--out", out("report-unfinished")], ("no finished run",),
        unchanged=(stopped,), absent=(out("report-unfinished"),))
    c["nlq report with an unknown --baseline"] = Case(
        ["report", ref, nl, "--baseline", "nosuch", "--out", out("report-base")],
        ("nosuch", "--baseline"), absent=(out("report-base"),))
    c["--resume on a file"] = Case(["train", "--resume", okc], (str(okc), "not an nlq run dir"))

    # -- configs ----------------------------------------------------------------------------
    train("malformed TOML", cfg_file("malformed.toml", text.replace("n_layer = 1", "n_layer = ")),
          names=("malformed.toml", "not valid TOML", "line 5"))
    train("unknown section", cfg_file("section.toml", text + "\n[optim]\nlr = 1\n"),
          names=("optim",))
    train("string for an int", cfg_file("type.toml", text.replace("n_head = 2", 'n_head = "two"')),
          names=("model.n_head", "'two'"))
    train("a section that is not a table", cfg_file("table.toml", "model = 3\n"),
          names=("'model'", "table"))
    train("train.lr = nan", cfg_file("nan.toml", text.replace("lr = 0.01", "lr = nan")),
          names=("train.lr", "nan"))
    train("train.lr = inf", okc, "--set", "train.lr=inf", names=("train.lr", "inf"))
    train("train.micro_batch = 0", okc, "--set", "train.micro_batch=0",
          names=("train.micro_batch", "0"))
    train("train.max_steps = -1", okc, "--set", "train.max_steps=-1",
          names=("train.max_steps", "-1"))
    train("model.d_model not divisible by n_head", okc, "--set", "model.n_head=3",
          names=("model.d_model", "model.n_head = 3"))
    train("unknown query variant", okc, "--set", "model.query=quadratic",
          names=("model.query", "quadratic"))
    train("non-UTF-8 config", cfg_file("latin1.toml", text.encode() + "# Bär\n".encode("latin-1")),
          names=("latin1.toml", "UTF-8"))
    train("binary file as config", cfg_file("blob.toml", bytes(range(256)) * 4),
          names=("blob.toml",))
    bad_run = stopped_at_6(ref, tmp / "run-with-bad-config")
    (bad_run / "config.toml").write_text(text.replace("[train]", "[train"))
    c["--resume with a malformed config.toml"] = Case(
        ["train", "--resume", bad_run], (str(bad_run / "config.toml"), "not valid TOML"),
        unchanged=(bad_run,))

    # -- data ---------------------------------------------------------------------------------
    def bad_data(name: str) -> Path:
        return make_data(tmp / "data" / name, n_train=2000, n_val=400)

    def on_data(name: str, d: Path, *sets, names=(), **kw):
        train(name, okc, "--set", f'data.dir="{d}"', *sets, names=names,
              unchanged=(d, *kw.pop("unchanged", ())), **kw)

    d = edit_meta(bad_data("vocab70k"), vocab_size=70000)
    on_data("meta.json vocab 70000 in uint16", d, "--set", "model.vocab_size=70016",
            names=("meta.json", "70000", "uint16"))

    def trained(run: Path):
        assert json.loads((run / "summary.json").read_text())["status"] == "finished"

    # a padded vocab beyond what the data's dtype holds is fine (as 50304 > 50257 in the
    # paper): the model has unused ids, the data's ids all fit
    c["model.vocab_size beyond the data's uint16"] = Case(
        ["train", okc, "--set", "model.vocab_size=70000", "--set", "train.max_steps=2",
         "--out", tmp / "wide-vocab", "--no-progress"], ok=True, unchanged=(data,),
        after=lambda: trained(tmp / "wide-vocab"))
    on_data("context longer than the data", data, "--set", "model.block_size=5000",
            names=("val.bin", "5001", "model.block_size"))
    d = bad_data("truncated")
    (d / "train.bin").write_bytes((d / "train.bin").read_bytes()[:-10])
    on_data("truncated train.bin", d, names=(str(d / "train.bin"), "truncated"))
    on_data("meta.json says uint32 for uint16 bins", edit_meta(bad_data("u32"), dtype="uint32"),
            names=("train.bin", "uint32"))
    on_data("meta.json says float16", edit_meta(bad_data("f16"), dtype="float16"),
            names=("meta.json", "float16"))
    on_data("meta.json without vocab_size", edit_meta(bad_data("novocab"), vocab_size=None),
            names=("meta.json", "vocab_size"))
    d = bad_data("badjson")
    (d / "meta.json").write_text('{"dtype": "uint16",')
    on_data("meta.json not JSON", d, names=(str(d / "meta.json"), "not valid JSON"))
    d = bad_data("out-of-vocab")
    ids = np.fromfile(d / "train.bin", dtype=np.uint16)
    ids[::7] = 60000  # meta.json says vocab_size 301
    ids.tofile(d / "train.bin")
    on_data("ids in train.bin beyond meta.json's vocab", d,
            names=("train.bin", "60000", "vocab_size 301", "step 1"))
    # found at the first step that reads one (scanning a 9B-token bin up front would cost
    # minutes): the run has started then (its config.toml is written), without a checkpoint
    c["ids in train.bin beyond meta.json's vocab"].absent = ()
    d = edit_meta(bad_data("empty-val"), val_tokens=0)
    (d / "val.bin").write_bytes(b"")
    on_data("empty val.bin", d, names=("val.bin", "0 tokens"))
    train("data dir is a file", okc, "--set", f'data.dir="{okc}"', names=(str(okc),))

    # -- nlq prepare: the earlier data dir (a finished make_data dir) must survive ----------
    src = tmp / "src"
    for name, body in {"empty": None, "blank": {"a.txt": b"  \n\n", "b.txt": b"\n"},
                       "latin1": {"a.txt": "Der Bär läuft über die Straße.\n".encode("latin-1")},
                       "binary": {"a.txt": bytes(range(256)) * 8}}.items():
        (src / name).mkdir(parents=True)
        for f, b in (body or {}).items():
            (src / name / f).write_bytes(b)
    first = make_data(tmp / "earlier-data", n_train=2000, n_val=400)
    copies = itertools.count()

    def earlier() -> Path:
        # a copy per case: the cases run 3 at a time, and two prepares into one folder would
        # meet its lock ("being written by another nlq prepare") instead of the bad input
        return Path(shutil.copytree(first, tmp / f"earlier-data-{next(copies)}"))

    def prepare(name: str, *args, names=(), over: Path | None = None):
        c[name] = Case(["prepare", *args, "--workers", "1"], names,
                       unchanged=(over,) if over else ())

    d = earlier()
    prepare("empty corpus", "--source", src / "empty", "--out", d, "--force",
            names=(str(src / "empty"), "no .txt"), over=d)
    d = earlier()
    prepare("corpus of blank files", "--source", src / "blank", "--out", d, "--force",
            names=(str(src / "blank"), "no text"), over=d)
    d = earlier()
    prepare("non-UTF-8 text", "--source", src / "latin1", "--out", d, "--force",
            names=(str(src / "latin1" / "a.txt"), "UTF-8", "0xe4"), over=d)
    d = earlier()
    prepare("binary file as text", "--source", src / "binary", "--out", d, "--force",
            names=(str(src / "binary" / "a.txt"), "binary"), over=d)
    d = earlier()
    prepare("prepare over other data without --force", "--source", src / "latin1", "--out", d,
            names=(str(d), "--force"), over=d)
    prepare("prepare --out is a file", "--out", okc, names=(str(okc), "not a folder"))
    prepare("unknown tokenizer size", "--tokenizer", "bpe:0", "--out", out("p-tok"),
            names=("bpe:0",))
    prepare("--val-fraction 1.5", "--val-fraction", "1.5", "--out", out("p-vf"),
            names=("--val-fraction", "1.5"))
    c["prepare --workers 0"] = Case(["prepare", "--workers", "0", "--out", out("p-w")],
                                    ("--workers", "0"), absent=(out("p-w"),))
    prepare("hf: without a name", "--source", "hf:", "--out", out("p-hf"), names=("hf:",))

    # -- checkpoints ----------------------------------------------------------------------
    def resume(name: str, run: Path, names=(), **kw):
        c[name] = Case(["train", "--resume", run, "--no-progress"], names, **kw)

    run = stopped_at_6(ref, tmp / "other-arm")
    shutil.rmtree(run / "ckpt" / "step_000006")
    shutil.copytree(nl / "ckpt" / "step_000006", run / "ckpt" / "step_000006")
    resume("checkpoint of another arm", run, ("step_000006", "changed since checkpoint",
                                               "model.query = 'nonlinear' -> 'linear'"),
           unchanged=(run,))
    run = stopped_at_6(ref, tmp / "other-shape")
    shutil.rmtree(run / "ckpt" / "step_000006")
    shutil.copytree(nl / "ckpt" / "step_000006", run / "ckpt" / "step_000006")
    st = run / "ckpt" / "step_000006" / "state.json"  # claims to be of this model: it lies
    state = json.loads(st.read_text())
    state["depends"]["config"] = cfg.to_dict()
    st.write_text(json.dumps({**state, "model_config": cfg.to_dict()["model"]}))
    resume("checkpoint of another shape", run, ("step_000006", "does not fit", "q.w1.weight"),
           unchanged=(run,))

    def recovers(name: str, run: Path, *warns: str):
        # resumes from what verifies, warns, and ends bitwise equal to the uninterrupted run
        resume(name, run, ok=True, warns=warns, after=lambda: assert_same_final(ref, run))

    run = stopped_at_6(ref, tmp / "truncated-ckpt")
    p = run / "ckpt" / "step_000006" / "model.safetensors"
    p.write_bytes(p.read_bytes()[:1000])
    recovers("truncated newest model.safetensors", run, "skipping checkpoint",
             str(run / "ckpt" / "step_000006"), "sha256")
    run = stopped_at_6(ref, tmp / "no-latest")
    (run / "ckpt" / "latest").unlink()
    shutil.rmtree(run / "ckpt" / "step_000004")  # so `newest` and `oldest` differ
    recovers("missing latest pointer", run, str(run / "ckpt" / "latest"), "missing")
    run = stopped_at_6(ref, tmp / "latest-to-nowhere")
    (run / "ckpt" / "latest").write_text("step_000099\n")
    recovers("latest names a missing checkpoint", run, "step_000099", "not there")
    run = stopped_at_6(ref, tmp / "state-lacks-keys")
    st = run / "ckpt" / "step_000006" / "state.json"
    st.write_text(json.dumps({k: v for k, v in json.loads(st.read_text()).items()
                              if k not in ("tokens", "elapsed")}))
    recovers("newest state.json lacks keys", run, "step_000006", "lacks tokens")
    run = stopped_at_6(ref, tmp / "state-not-json")
    (run / "ckpt" / "step_000006" / "state.json").write_text("[1, 2")
    recovers("newest state.json not JSON", run, "step_000006", "unreadable state.json")
    c["--out under a file"] = Case(["train", okc, "--out", okc / "run"],
                                   (str(okc / "run"), "Not a directory"))
    return c


def run_all(runner: Runner, arg_lists: dict[str, list], parallel: int = 3) -> dict:
    """Every command as its own process, `parallel` at a time."""
    queue, running, done = list(arg_lists), {}, {}
    while queue or running:
        while queue and len(running) < parallel:
            name = queue.pop(0)
            running[name] = runner.start(*arg_lists[name])
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                done[name] = proc.wait()
                del running[name]
        time.sleep(0.01)
    return done


MODES = ["zygote", pytest.param("subprocess", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=MODES)
def results(request, tmp_path_factory, data, zygote):
    runner = zygote if request.param == "zygote" else subprocess_runner(tmp_path_factory)
    tmp = tmp_path_factory.mktemp(f"bad-inputs-{request.param}")
    ref = reference(zygote, tmp_path_factory, tiny_config(data, **SHORT))
    nl = reference(zygote, tmp_path_factory,
                   tiny_config(data, **SHORT, **{"model.query": "nonlinear"}))
    cases = build_cases(tmp, data, ref, nl)
    shared = {d: snapshot(d) for d in (data, ref, nl)}
    for case in cases.values():
        case.before = {d: snapshot(d) for d in case.unchanged}
    done = run_all(runner, {name: case.args for name, case in cases.items()})
    yield cases, done
    for d, snap in shared.items():  # what every test shares was never written
        assert snapshot(d) == snap, d


def test_at_least_25_distinct_bad_inputs(results):
    cases, _ = results
    assert list(cases) == CASES  # the catalogue above is what runs
    assert len(CASES) >= 25


@pytest.mark.parametrize("name", CASES)
def test_bad_input(results, name):
    cases, done = results
    case, p = cases[name], done[name]
    print(f"\n{name}: exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    assert "Traceback" not in p.stderr, p.stderr
    if case.ok:
        assert p.returncode == 0, p.stderr
        for w in case.warns:
            assert w in p.stderr, f"{w!r} not in {p.stderr!r}"
        if case.after is not None:
            case.after()
    else:
        assert p.returncode == 2, (p.returncode, p.stderr)
        last = assert_user_error(p, *case.names)
        lines = p.stderr.strip().splitlines()
        if case.argparse:
            assert lines[0].startswith("usage: nlq"), p.stderr
        else:  # one error line, at most preceded by nlq's own warnings
            assert all(x.startswith("nlq: warning:") for x in lines[:-1]), p.stderr
        assert len(last) < 1000
    for d, snap in case.before.items():
        assert snapshot(d) == snap, f"{d} changed"
    for a in case.absent:
        assert not Path(a).exists(), f"{a} was created"


# -- the entry point itself: real `python -m nlq` processes in the default tier too ------


def test_real_processes_answer_as_the_zygote(results, tmp_path_factory, zygote):
    """A few cases as real `python -m nlq` subprocesses: the same exit status and stderr
    as the zygote's children, so the zygote stands for the real command."""
    cases, done = results
    names = ["unknown flag", "malformed TOML", "meta.json vocab 70000 in uint16"]
    real = run_all(subprocess_runner(tmp_path_factory), {n: cases[n].args for n in names})
    for n in names:
        assert (real[n].returncode, real[n].stderr) == (done[n].returncode, done[n].stderr), n


@pytest.mark.parametrize("where", ["after the command", "before the command"])
def test_debug_shows_the_traceback(tmp_path, tmp_path_factory, where):
    """--debug (after the subcommand, or before it: `nlq --debug train`) shows the
    traceback of the same error, as a real `python -m nlq` process."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    args = ["train", bad, "--debug"] if where == "after the command" else \
        ["--debug", "train", bad]
    p = subprocess_runner(tmp_path_factory).run(*args)
    assert p.returncode == 1, p.stderr
    assert p.stderr.startswith("Traceback"), p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("nlq.errors.NlqError: config file") and str(bad) in last


# -- a read-only output dir and a full disk, as real mounts -------------------------------


def mount(*args) -> bool:
    return subprocess.run(["mount", *map(str, args)], capture_output=True,
                          check=False).returncode == 0


@pytest.fixture
def mounts():
    done = []

    def do(*args) -> None:
        if not mount(*args):
            pytest.skip("cannot mount here (needs root): see the in-process ENOSPC test in "
                        "tests/test_train_errors.py")
        if not any("remount" in str(a) for a in args):
            done.append(args[-1])

    yield do
    for target in reversed(done):
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_read_only_dir(tmp_path, data, mounts, zygote, tmp_path_factory):
    """A read-only bind mount over a finished run, a stopped run and a data dir: a new run,
    a resume and a prepare there fail naming the dir; resuming the finished run is a clean
    no-op; every file stays byte-identical."""
    ref = reference(zygote, tmp_path_factory, tiny_config(data, **SHORT))
    src, ro = tmp_path / "src", tmp_path / "ro"
    ro.mkdir()
    shutil.copytree(ref, src / "finished")
    stopped_at_6(ref, src / "stopped")
    make_data(src / "data", n_train=2000, n_val=400)
    (src / "corpus").mkdir()
    for i in range(3):  # the split is by document: three at least (train, val, test)
        (src / "corpus" / f"{i}.txt").write_text("some text\n" * 500)
    cfg = write_config(tmp_path / "ok.toml", tiny_config(data, **SHORT))
    mounts("--bind", src, ro)
    mounts("-o", "remount,bind,ro", ro)
    before = snapshot(ro)
    p = zygote.run("train", cfg, "--out", ro / "new", "--no-progress")
    assert_user_error(p, f"cannot write run dir {ro / 'new'}", "Read-only file system")
    p = zygote.run("train", "--resume", ro / "stopped", "--no-progress")
    assert_user_error(p, f"cannot write run dir {ro / 'stopped'}", "Read-only file system")
    p = zygote.run("prepare", "--source", ro / "corpus", "--tokenizer", "gpt2", "--out",
                   ro / "data", "--force", "--workers", "1")
    assert_user_error(p, f"nlq prepare into {ro / 'data'} failed", "Read-only file system")
    p = zygote.run("train", "--resume", ro / "finished", "--no-progress")
    assert p.returncode == 0 and "already finished at step 8" in p.stderr, p.stderr
    assert snapshot(ro) == before


def test_full_disk_during_training(tmp_path, data, mounts, zygote, tmp_path_factory):
    """A tmpfs that holds the data and the first checkpoint but not the second: the run
    stops naming the checkpoint and ENOSPC; the first checkpoint (bitwise the reference's),
    `latest` and the data on that disk stay; once the disk is larger, --resume ends bitwise
    equal to the uninterrupted run."""
    ref = reference(zygote, tmp_path_factory, tiny_config(data, **SHORT))
    ckpt = sum(f.stat().st_size for f in (ref / "ckpt" / "step_000002").iterdir())
    size = sum(f.stat().st_size for f in data.iterdir()) + int(1.5 * ckpt) + 64 * 1024
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", f"size={size // 4096 * 4096}", "tmpfs", disk)
    local = disk / "data"  # the same tokens as the reference's: the same weights
    shutil.copytree(data, local)
    data_before = snapshot(local)
    run = disk / "run"
    cfg = write_config(tmp_path / "c.toml", tiny_config(local, **SHORT))
    p = zygote.run("train", cfg, "--out", run, "--no-progress")
    assert p.returncode == 2
    assert_user_error(p, str(run / "ckpt" / "step_000004"), "No space left on device",
                      f"nlq train --resume {run}")
    assert sorted(x.name for x in (run / "ckpt").iterdir()) == ["latest", "step_000002"]
    assert (run / "ckpt" / "latest").read_text() == "step_000002\n"
    assert not (run / "summary.json").exists()
    for f in ("model.safetensors", "optim.safetensors"):
        assert (run / "ckpt" / "step_000002" / f).read_bytes() == \
            (ref / "ckpt" / "step_000002" / f).read_bytes()
    assert snapshot(local) == data_before
    mounts("-o", f"remount,size={4 * size}", disk)  # free space
    helpers.ok(zygote.run("train", "--resume", run, "--no-progress"))
    assert_same_final(ref, run)


def test_full_disk_during_prepare(tmp_path, mounts, zygote):
    """nlq prepare --force of a larger corpus onto a nearly full disk: one line naming the
    output and ENOSPC, no .tmp file left, the data prepared there before byte-identical."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=256k", "tmpfs", disk)
    earlier = make_data(disk / "data", n_train=2000, n_val=400)
    before = snapshot(earlier)
    (tmp_path / "corpus").mkdir()
    words = " ".join(f"w{i}" for i in range(20000))
    for i in range(4):
        (tmp_path / "corpus" / f"{i}.txt").write_text(words + "\n")
    p = zygote.run("prepare", "--source", tmp_path / "corpus", "--tokenizer", "gpt2", "--out",
                   earlier, "--force", "--workers", "1")
    assert_user_error(p, f"nlq prepare into {earlier} failed", "No space left on device")
    assert snapshot(earlier) == before


def test_full_disk_during_export(tmp_path, data, mounts, zygote, tmp_path_factory):
    """nlq export onto a disk that holds part of the results: one line naming ENOSPC; every
    file written there is whole (the source's bytes), none half-written, no temporary file;
    onto a larger disk the same command completes."""
    ref = reference(zygote, tmp_path_factory, tiny_config(data, **SHORT))
    src = tmp_path / "src"
    for k in range(6):
        shutil.copytree(ref, src / "runs" / "linear" / f"seed{k}",
                        ignore=shutil.ignore_patterns("ckpt", "tb"))
    whole = tmp_path / "whole"
    helpers.ok(zygote.run("export", src, whole))
    total = sum(f.stat().st_size for f in whole.rglob("*") if f.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", f"size={max(total // 2, 16384)}", "tmpfs", disk)
    p = zygote.run("export", src, disk / "results")
    assert_user_error(p, "No space left on device")
    written = [f for f in (disk / "results").rglob("*") if f.is_file()]
    assert written and not any(f.name.endswith(".tmp") for f in written)
    for f in written:  # whole, or not there at all
        assert f.read_bytes() == (whole / f.relative_to(disk / "results")).read_bytes(), f
    mounts("-o", f"remount,size={4 * total + 65536}", disk)
    helpers.ok(zygote.run("export", src, disk / "results"))
    assert snapshot(disk / "results") == snapshot(whole)
