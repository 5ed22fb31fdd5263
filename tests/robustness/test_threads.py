"""Thread counts: a CPU run's bits depend on its intra-op thread count (the order floats are
summed in), so train.threads fixes it and summary.json records it with the ISA and the CPU.

- The same config at the same thread count gives bitwise-equal val_loss and final weights.
- A run at another thread count records that count.
- A thread count that is not a whole number from 1 to this machine's cores (reproduce
  --threads, train.threads) is one error line, exit 2, and no output folder.

Processes are zygote children (conftest.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import helpers
import pytest
from helpers import assert_same_final, assert_user_error, ok

from nlq.sysinfo import cores

one_thread = helpers.one_thread  # autouse

# the tiny preset cut to a few steps of a 1-layer model on the Markov test data
SMALL = ["model.vocab_size=320", "model.block_size=16", "model.n_layer=1", "model.n_head=2",
         "model.d_model=32", "model.mlp_hidden=64", "train.micro_batch=4", "train.grad_accum=1",
         "train.max_steps=4", "train.eval_interval=2", "train.eval_batches=2",
         "train.ckpt_interval=4", "train.warmup_steps=1", "train.log_interval=1"]


def train(zygote, data: Path, out: Path, *sets: str):
    args = [a for s in [f'data.dir="{data}"', *SMALL, *sets] for a in ("--set", s)]
    return zygote.run("train", "tiny", *args, "--out", out, "--no-progress")


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_same_thread_count_is_bitwise_equal(zygote, data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        ok(train(zygote, data, run, "train.threads=1"))
    sa, sb = summary(a), summary(b)
    assert sa["val_loss"] == sb["val_loss"]  # exactly: the same floats summed alike
    assert sa["threads"] == sb["threads"] == 1
    assert sa["isa"] == sb["isa"] and sa["cpu"] == sb["cpu"] and sa["isa"]
    assert_same_final(a, b)


@pytest.mark.skipif(cores() < 2, reason="needs 2 cores")
def test_another_thread_count_is_recorded(zygote, data, tmp_path):
    ok(train(zygote, data, tmp_path / "two", "train.threads=2"))
    s = summary(tmp_path / "two")
    assert s["threads"] == 2 and s["isa"] and s["cpu"]


@pytest.mark.parametrize("value, names", [
    ("0", ["--threads", ">= 1"]),
    ("-1", ["--threads", ">= 1"]),
    ("1.5", ["--threads", "1.5"]),  # argparse's answer: usage, then the error line
    ("99999", ["--threads", "99999", "cores"]),
])
def test_reproduce_refuses_a_bad_thread_count(zygote, tmp_path, value, names):
    out = tmp_path / "out"
    p = zygote.run("reproduce", "--preset", "tiny", "--out", out, "--threads", value)
    assert p.returncode == 2, p.stderr
    assert_user_error(p, *names)
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("value, names", [
    ("0", ["train.threads", "0"]),
    ("99999", ["train.threads", "99999"]),  # over the config's range
    (str(cores() + 1), ["train.threads", str(cores() + 1), "cores"]),  # over this machine's
])
def test_train_refuses_a_bad_thread_count(zygote, data, tmp_path, value, names):
    out = tmp_path / "run"
    p = train(zygote, data, out, f"train.threads={value}")
    assert p.returncode == 2, p.stderr
    assert_user_error(p, *names)
    assert not out.exists() and os.listdir(tmp_path) == []
