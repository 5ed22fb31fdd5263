"""Robustness of the commands that read a trained model (eval, sample, convert) and of --import.

- A run whose newest checkpoint fails to verify is refused by eval, sample and convert (one
  line naming the checkpoint, why, and the steps --step may choose), never scored or written
  from an older checkpoint in its place; resume still falls back to the older one.
- --step N chooses a checkpoint; every result names the step it is of: eval's text and JSON,
  sample's stderr header, the nlq_convert.json of convert's folder. A step that is not there,
  or one that contradicts a checkpoint dir or saved folder given, is one error line.
- convert --out refuses a folder of the user's (files, a symlink, a file) and leaves it
  byte-identical; an empty folder, or one an earlier convert wrote, is (re)written whole.
- --import of a file whose code raises is one line naming the file and the exception; --debug
  shows the traceback through the user's code.

Processes are zygote children (conftest.py), one real `python -m nlq` for --debug.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import helpers
import pytest
from conftest import subprocess_runner
from helpers import assert_user_error, make_bpe_data, ok, snapshot, tiny_config, write_config

from nlq.config import load_config

one_thread = helpers.one_thread  # autouse

NEWEST = "step_000006"


@pytest.fixture(scope="module")
def run(tmp_path_factory, zygote) -> Path:
    """A finished tiny run with checkpoints at steps 2, 4 and 6, on data with a trained BPE
    (sample and convert need a real tokenizer)."""
    base = tmp_path_factory.mktemp("steps")
    d = make_bpe_data(base / "data")
    cfg = write_config(base / "c.toml", tiny_config(d, **{
        "model.vocab_size": 300, "train.max_steps": 6, "train.ckpt_interval": 2,
        "train.keep_checkpoints": 10}))
    r = base / "run"
    ok(zygote.run("train", cfg, "--out", r, "--no-progress"))
    return r


@pytest.fixture
def corrupt(run, tmp_path) -> Path:
    """A copy of the run whose newest checkpoint's weights were cut short."""
    r = tmp_path / "run"
    shutil.copytree(run, r)
    w = r / "ckpt" / NEWEST / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    return r


def eval_json(zygote, *args) -> dict:
    return json.loads(ok(zygote.run("eval", *args, "--json")).stdout)


# -- which checkpoint ------------------------------------------------------------------------


def test_newest_failing_to_verify_is_refused_by_eval_sample_and_convert(corrupt, zygote,
                                                                        tmp_path):
    before = snapshot(corrupt)
    out = tmp_path / "hf"
    for args in (["eval", corrupt], ["sample", corrupt, "--max-new-tokens", "3"],
                 ["convert", corrupt, "--out", out]):
        p = zygote.run(*args)
        assert p.returncode == 2, p.stderr
        last = assert_user_error(p, NEWEST, "model.safetensors", "sha256", "--step (2, 4 verify)")
        assert p.stdout == "", p.stdout  # no score, no text: nothing of another step
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr  # no fallback warning either
        assert "newest checkpoint" in last
    assert snapshot(corrupt) == before
    assert not out.exists() and os.listdir(tmp_path) == ["run"]


def test_no_checkpoint_verifies(corrupt, zygote):
    for s in ("step_000002", "step_000004"):
        (corrupt / "ckpt" / s / "state.json").write_text("{")
    assert_user_error(zygote.run("eval", corrupt), NEWEST, "no checkpoint of this run verifies")
    assert_user_error(zygote.run("eval", corrupt, "--step", "4"), "step_000004",
                      "unreadable state.json", "no checkpoint of this run verifies")


def test_resume_still_falls_back_to_the_newest_that_verifies(corrupt, zygote):
    """Training keeps its fallback: a resume from step 4 redoes 5 and 6 (a finished run is not
    resumed, so its summary goes first)."""
    (corrupt / "summary.json").unlink()
    p = ok(zygote.run("train", "--resume", corrupt, "--no-progress"))
    assert f"skipping checkpoint {corrupt / 'ckpt' / NEWEST}" in p.stderr
    assert eval_json(zygote, corrupt)["step"] == 6


def test_step_chooses_and_every_result_names_it(run, corrupt, zygote, tmp_path):
    summary = json.loads((run / "summary.json").read_text())
    newest = eval_json(zygote, run)
    assert newest["step"] == summary["step"] == 6
    assert newest["checkpoint"] == str(run / "ckpt" / NEWEST)
    assert newest["log_loss"] == pytest.approx(summary["test_loss"], rel=1e-9)
    at4 = eval_json(zygote, corrupt, "--step", "4")
    assert at4["step"] == 4 and at4["checkpoint"].endswith("step_000004")
    assert at4["log_loss"] != newest["log_loss"]
    # the checkpoint dir itself, with or without its own step: the same model
    ckpt4 = corrupt / "ckpt" / "step_000004"
    assert eval_json(zygote, ckpt4)["log_loss"] == at4["log_loss"]
    assert eval_json(zygote, ckpt4, "--step", "4")["step"] == 4
    text = ok(zygote.run("eval", corrupt, "--step", "4")).stdout
    assert text.splitlines()[0] == f"{ckpt4}, step 4", text
    p = ok(zygote.run("sample", corrupt, "--step", "2", "--max-new-tokens", "3"))
    assert p.stderr.splitlines()[0] == f"nlq: sampling {corrupt / 'ckpt' / 'step_000002'}, step 2"


def test_bad_step_values(run, zygote, tmp_path):
    assert_user_error(zygote.run("eval", run, "--step", "5"), str(run), "step 5",
                      "one of 2, 4, 6")
    assert_user_error(zygote.run("sample", run, "--step", "-1"), "step -1", "2, 4, 6")
    assert_user_error(zygote.run("eval", run / "ckpt" / NEWEST, "--step", "4"), "--step 4",
                      NEWEST, "of step 6")
    p = zygote.run("eval", run, "--step", "four")  # argparse: its own usage line, exit 2
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--step" in p.stderr
    saved = tmp_path / "saved"  # a save_pretrained folder: it says no step
    saved.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(run / "ckpt" / NEWEST / name, saved / name)
    assert_user_error(zygote.run("eval", saved, "--step", "6"), "--step 6", str(saved),
                      "step unknown")
    data = load_config(run / "config.toml").data.dir
    r = eval_json(zygote, saved, "--data", data)
    assert r["step"] is None and r["checkpoint"] == str(saved)


# -- convert --out ---------------------------------------------------------------------------


def test_convert_names_its_step_and_replaces_only_its_own_folder(run, corrupt, zygote,
                                                                 tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    p = ok(zygote.run("convert", corrupt, "--step", "4", "--to", "hf", "--out", out))
    assert "step 4" in p.stdout
    rec = json.loads((out / "nlq_convert.json").read_text())
    assert rec["step"] == 4 and rec["source"] == str((corrupt / "ckpt" / "step_000004").resolve())
    assert rec["format"] == "hf"
    assert (out / "tokenizer.json").is_file()
    (out / "stale.txt").write_text("left by hand in a folder convert wrote\n")
    ok(zygote.run("convert", run, "--to", "hf", "--out", out))  # its own folder: replaced whole
    assert json.loads((out / "nlq_convert.json").read_text())["step"] == 6
    assert not (out / "stale.txt").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.convert")]
    empty = tmp_path / "empty"
    empty.mkdir()
    ok(zygote.run("convert", run, "--to", "hf", "--out", empty))
    assert (empty / "model.safetensors").is_file()


@pytest.mark.parametrize("kind", ["their model folder", "a symlink", "a file"])
def test_convert_refuses_a_folder_of_the_users(run, zygote, tmp_path, kind):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"my": "model"}\n')
    (mine / "model.safetensors").write_bytes(b"my weights")
    out, names = mine, ["not empty", "config.json", "model.safetensors"]
    if kind == "a symlink":
        out = tmp_path / "link"
        out.symlink_to(tmp_path / "elsewhere", target_is_directory=True)  # dangling
        names = ["symbolic link"]
    elif kind == "a file":
        out = mine / "config.json"
        names = ["is a file"]
    before = snapshot(tmp_path)
    p = zygote.run("convert", run, "--to", "hf", "--out", out)
    assert p.returncode == 2, p.stderr
    assert_user_error(p, str(out), *names)
    assert snapshot(tmp_path) == before
    assert sorted(os.listdir(tmp_path)) == sorted(["mine"] + (["link"] if kind == "a symlink"
                                                              else []))


# -- --import --------------------------------------------------------------------------------


RAISES = "X = 1\n\ndef f():\n    raise ValueError('boom from the user')\n\nf()\n"


@pytest.mark.parametrize("body, what", [(RAISES, "ValueError: boom from the user"),
                                        ("def f(:\n", "SyntaxError"),
                                        ("import no_such_module_q\n", "ModuleNotFoundError")])
def test_import_of_code_that_raises_is_one_line(zygote, tmp_path, body, what):
    user = tmp_path / "mine.py"
    user.write_text(body)
    p = zygote.run("--import", user, "params", "--preset", "tiny")
    assert p.returncode == 2, p.stderr
    assert_user_error(p, str(user), what)
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stdout == ""


def test_import_error_with_debug_shows_the_users_traceback(tmp_path, tmp_path_factory):
    user = tmp_path / "mine.py"
    user.write_text(RAISES)
    p = subprocess_runner(tmp_path_factory).run("--debug", "--import", user, "params",
                                                "--preset", "tiny")
    assert p.returncode == 1 and p.stderr.startswith("Traceback"), p.stderr
    assert f'File "{user}", line 4, in f' in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("nlq.errors.NlqError: --import")
