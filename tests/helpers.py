"""Shared helpers of the training tests: a small learnable token data set, a tiny config,
`nlq` subprocesses, and readers for what a run dir holds.

Imported as `from helpers import ...`: pytest's default "prepend" import mode puts tests/ on
sys.path (no __init__.py there).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nlq.config import Config, ModelConfig, from_dict

ROOT = Path(__file__).resolve().parents[1]
# subprocesses run on the interpreter that runs pytest: any venv with `pip install -e ".[dev]"`
PY = sys.executable

N_SYMBOLS = 300  # ids 0..299 occur in the text
MASK_ID = 300  # reserved: never occurs in the text
VOCAB = 320  # the model's vocab (padded)


def markov_tokens(n: int, seed: int, n_symbols: int = N_SYMBOLS) -> np.ndarray:
    """A seeded first-order Markov chain: each symbol has 4 likely successors (90% of the
    mass) so a tiny model learns it in a few dozen steps; the rest is uniform noise."""
    rng = np.random.default_rng(12345)  # one transition table for train and val
    succ = rng.integers(0, n_symbols, size=(n_symbols, 4))
    draw = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.uint16)
    s = 0
    u, pick, noise = draw.random(n), draw.integers(0, 4, n), draw.integers(0, n_symbols, n)
    for i in range(n):
        s = succ[s, pick[i]] if u[i] < 0.9 else noise[i]
        out[i] = s
    return out


EOT = N_SYMBOLS - 1  # the test split's documents end where this symbol occurs


def make_data(d: Path, n_train: int = 40_000, n_val: int = 4_000, vocab_size: int = N_SYMBOLS + 1,
              mask_id: int | None = MASK_ID, n_test: int | None = 2_000) -> Path:
    """Write a token data dir as `nlq prepare` does: train.bin, val.bin, test.bin (uint16;
    n_test None: none), meta.json."""
    d.mkdir(parents=True, exist_ok=True)
    train, val = markov_tokens(n_train, 1), markov_tokens(n_val, 2)
    train.tofile(d / "train.bin")
    val.tofile(d / "val.bin")
    meta = {"dtype": "uint16", "vocab_size": vocab_size, "train_tokens": n_train,
            "val_tokens": n_val, "tokenizer": "markov-test", "eot_id": EOT}
    if n_test is not None:
        test = markov_tokens(n_test, 3)
        test[-1] = EOT  # the last document is closed like every other
        test.tofile(d / "test.bin")
        meta["test_tokens"] = n_test
    if mask_id is not None:
        meta["mask_id"] = mask_id
    (d / "meta.json").write_text(json.dumps(meta))
    return d


TINY = {
    "model": {"arch": "decoder", "vocab_size": VOCAB, "block_size": 16, "n_layer": 1,
              "n_head": 2, "d_model": 32, "mlp_hidden": 64},
    "train": {"micro_batch": 4, "grad_accum": 2, "max_steps": 6, "lr": 1e-2, "min_lr": 1e-3,
              "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 1.0, "eval_interval": 3,
              "eval_batches": 2, "log_interval": 1, "ckpt_interval": 3, "keep_checkpoints": 2,
              "device": "cpu", "precision": "fp32", "compile": False},
    "data": {"seed": 7},
}


# checkpoints at 2, 4, 6, 8 (all kept); eval at 0, 2, 4, 6, 8 with 2 val chunks each; dropout
# on, so a resumed run must draw the same dropout masks too
SHORT = {"train.max_steps": 8, "train.ckpt_interval": 2, "train.eval_interval": 2,
         "train.keep_checkpoints": 10, "model.dropout": 0.1}



def make_bpe_data(d: Path) -> Path:
    """make_data's token dir (vocab 300) whose meta.json names a real tiny trained BPE, so
    sample and convert can decode; for the inference tests."""
    from nlq.data.tokenizers import train_bpe

    make_data(d, vocab_size=300, mask_id=None)  # the BPE below has no mask token
    texts = ["the quick brown fox jumps over the lazy dog. " * 3,
             "a stitch in time saves nine; the early bird catches the worm. " * 3] * 20
    train_bpe(texts, 300, d / "tokenizer.json")
    meta = json.loads((d / "meta.json").read_text())
    meta["tokenizer"] = "bpe:300"
    (d / "meta.json").write_text(json.dumps(meta))
    return d

def tiny_model(**kw) -> ModelConfig:
    """A 2-layer, d=32 model config for tests that build modules directly, with overrides."""
    base = {"vocab_size": 100, "block_size": 16, "n_layer": 2, "n_head": 4, "d_model": 32,
            "mlp_hidden": 64}
    base.update(kw)
    return ModelConfig(**base)


def tiny_config(data_dir: Path | str, **overrides) -> Config:
    """The tiny test config (about a second to train) with dotted overrides, e.g.
    tiny_config(d, **{"train.max_steps": 10})."""
    raw = json.loads(json.dumps(TINY))
    raw["data"]["dir"] = str(data_dir)
    for key, value in overrides.items():
        sec, name = key.split(".")
        raw[sec][name] = value
    return from_dict(raw)


def write_config(path: Path, cfg: Config) -> Path:
    path.write_text(cfg.to_toml())
    return path


# -- subprocesses ----------------------------------------------------------------------------


def env(**extra) -> dict:
    """The environment of an `nlq` subprocess: one thread (2-core CI), no fault unless asked."""
    e = {k: v for k, v in os.environ.items() if k != "NLQ_FAULT"}
    e.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    e.update({k: str(v) for k, v in extra.items()})
    return e


def nlq_cmd(*args) -> list[str]:
    return [PY, "-m", "nlq", *map(str, args)]


def nlq(*args, timeout: float = 300, **env_extra) -> subprocess.CompletedProcess:
    """Run `python -m nlq ARGS` to completion; returns the CompletedProcess (text)."""
    return subprocess.run(nlq_cmd(*args), cwd=ROOT, env=env(**env_extra), capture_output=True,
                          text=True, timeout=timeout, check=False)


def nlq_train(cfg_path: Path, out: Path, *extra, **env_extra) -> subprocess.CompletedProcess:
    return nlq("train", cfg_path, "--out", out, "--no-progress", *extra, **env_extra)


def nlq_resume(run_dir: Path, **env_extra) -> subprocess.CompletedProcess:
    return nlq("train", "--resume", run_dir, "--no-progress", **env_extra)


def torchrun_cmd(nproc: int, *args) -> list[str]:
    """`torchrun ... -m nlq ARGS` as a module of PY's torch (no torchrun script on PATH needed);
    its workers are its direct children."""
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "nlq", *map(str, args)]


def popen_group(cmd: list[str], **env_extra) -> subprocess.Popen:
    """Start cmd in a session of its own, so kill_group() also reaches torchrun's workers."""
    return subprocess.Popen(cmd, cwd=ROOT, env=env(**env_extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def torchrun(nproc: int, *args, timeout: float = 300, **env_extra) -> subprocess.CompletedProcess:
    proc = popen_group(torchrun_cmd(nproc, *args), **env_extra)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)  # no orphaned worker survives a failure or a timeout
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return p


def assert_user_error(p: subprocess.CompletedProcess, *names: str) -> str:
    """The process failed with one `nlq: error:` line naming every one of `names`."""
    assert p.returncode != 0, f"expected a failure\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines, "nothing on stderr"
    last = lines[-1]
    assert last.startswith("nlq: error:"), p.stderr
    for n in names:
        assert str(n) in last, f"{n!r} not named in: {last}"
    return last


def shared_data(tmp_path_factory) -> Path:
    """One Markov data dir for the whole session (every test module reuses it)."""
    d = tmp_path_factory.getbasetemp() / "markov-data"
    return d if (d / "meta.json").is_file() else make_data(d)


def reference_run(tmp_path_factory, cfg: Config, nproc: int = 1, train=None) -> Path:
    """An uninterrupted `nlq train` subprocess of cfg (torchrun when nproc > 1), run once per
    session and config: the thing resumed and distributed runs are compared with. `train`
    (config path, run dir) -> CompletedProcess replaces the default 1-process launcher."""
    key = hashlib.sha1(f"{nproc}\n{cfg.to_toml()}".encode()).hexdigest()[:12]
    base = tmp_path_factory.getbasetemp() / f"ref-{key}"
    run = base / "run"
    if not (run / "summary.json").is_file():
        base.mkdir(exist_ok=True)
        if run.exists():
            shutil.rmtree(run)
        path = write_config(base / "config.toml", cfg)
        if nproc > 1:
            ok(torchrun(nproc, "train", path, "--out", run, "--no-progress"))
        else:
            ok((train or nlq_train)(path, run))
    return run


def stopped_at_6(ref: Path, dst: Path) -> Path:
    """A copy of a finished run with checkpoints at 6 and 8 (SHORT), as if killed just after
    its step-6 checkpoint."""
    shutil.copytree(ref, dst)
    (dst / "summary.json").unlink()
    shutil.rmtree(dst / "ckpt" / "step_000008")
    (dst / "ckpt" / "latest").write_text("step_000006\n")
    return dst


def wait_for(pred, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def interrupted_step(returncode: int, out: str, err: str, sig) -> int:
    """The step a run stopped at after `sig`: exit 0, an "interrupted" summary on stdout's last
    line, and the stop named on stderr."""
    assert returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["status"] == "interrupted", "the run ended before the signal"
    k = result["step"]
    assert f"stopped by signal {int(sig)} at step {k}" in err
    return k


def n_rows(run_dir: Path, kind: str) -> int:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return 0
    return sum(f'"kind": "{kind}"' in line for line in text.splitlines())


# -- what a run dir holds --------------------------------------------------------------------


def metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]


TIMING = ("elapsed", "tok_per_s", "peak_mem_mb")


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def ckpt_dirs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "ckpt").glob("step_*"))


def final_ckpt(run_dir: Path) -> Path:
    return run_dir / "ckpt" / (run_dir / "ckpt" / "latest").read_text().strip()


def load_ckpt(run_dir: Path, name: str | None = None) -> tuple[dict, dict]:
    d = run_dir / "ckpt" / name if name else final_ckpt(run_dir)
    return load_file(str(d / "model.safetensors")), load_file(str(d / "optim.safetensors"))


def assert_same_tensors(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        if atol == 0.0:
            assert torch.equal(x, b[k]), f"{k} differs"
        else:
            torch.testing.assert_close(x, b[k], atol=atol, rtol=0,
                                       msg=lambda m, k=k: f"{k}: {m}")


def assert_same_final(run_a: Path, run_b: Path, atol: float = 0.0) -> None:
    """Final weights and optimizer state equal: bitwise (atol=0) or within atol."""
    ma, oa = load_ckpt(run_a)
    mb, ob = load_ckpt(run_b)
    assert_same_tensors(ma, mb, atol)
    assert_same_tensors(oa, ob, atol)


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file under d (relative path -> bytes), to check nothing was changed."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine run ~10x faster on one intra-op thread (the
    subprocesses get OMP_NUM_THREADS=1); restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def o1_model(vocab_size: int, block_size: int, **kw):
    """A small nlq Transformer (2 layers, d 32, 4 heads) with O(1) random weights and
    non-trivial norms: logits that differ clearly wherever two implementations differ."""
    from nlq.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=4,
                      d_model=32, mlp_hidden=80, **kw)
    m = Transformer(cfg, seed=3).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name or ".ln_" in name else 0.3 * noise)
    return m


def freeze(proc) -> None:
    """SIGSTOP proc and wait until it has stopped: kill() returns before the signal is acted
    on, so a process on another core may still write a little after it."""
    proc.send_signal(signal.SIGSTOP)

    def stopped() -> bool:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] in "Tt"  # the field after "(comm)": the state

    wait_for(stopped, timeout=30, what=f"process {proc.pid} to stop")


def last_step(run: Path) -> int:
    """The last train step a run dir's metrics.jsonl logged (0: none yet, or unreadable)."""
    try:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    except (OSError, ValueError):
        return 0
    return max((r.get("step", 0) for r in rows if r.get("kind") == "train"), default=0)


def children_of(out: Path, what: str = " train ") -> list[int]:
    """Processes whose command line names OUT and holds `what`: by default the `nlq train`
    children of an experiment."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if what in cmd and str(out) in cmd:
                pids.append(int(d.name))
    return pids


def stoppable_experiment(mini_sets: list[str], max_steps: int, eval_interval: int
                         ) -> tuple[str, list[str]]:
    """(experiment TOML, --set values): linear and nonlinear on the mini experiment's settings
    (tests/test_reproduce.py SETS), one micro-step a step, max_steps long and evaluated every
    eval_interval steps: runs long enough to be stopped part way."""
    toml = (f'name = "stoppable"\nbaseline = "linear"\n[base]\ntrain.max_steps = {max_steps}\n'
            f'[arms.linear]\n[arms.nonlinear]\nmodel.query = "nonlinear"\n')
    sets = [s for s in mini_sets if s.split("=")[0] not in ("train.grad_accum",
                                                             "train.eval_interval")]
    return toml, [*sets, f"train.eval_interval={eval_interval}"]
