"""A run's set-up reads as one sequence, each step once (nlq/train/loop.py, train()): on a
resume, config.toml is read once (under the run's lock) and the data dir is opened and
checked once; a new run opens and checks its data once too. Counted in-process, through
`nlq train` as a user runs it."""

from __future__ import annotations

import pathlib
import shutil

import pytest
from helpers import shared_data, tiny_config, write_config

from nlq.cli import main
from nlq.data.schedule import TokenData


@pytest.fixture
def counted(monkeypatch):
    counts = {"config.toml reads": 0, "data opens": 0, "data checks": 0}
    read_text, read_bytes = pathlib.Path.read_text, pathlib.Path.read_bytes
    open_data, check_data = TokenData.open.__func__, TokenData.check

    def count_read(self, *a, **k):
        if self.name == "config.toml":
            counts["config.toml reads"] += 1
        return read_text(self, *a, **k)

    def count_read_bytes(self, *a, **k):
        if self.name == "config.toml":
            counts["config.toml reads"] += 1
        return read_bytes(self, *a, **k)

    def count_open(cls, *a, **k):
        counts["data opens"] += 1
        return open_data(cls, *a, **k)

    def count_check(self, *a, **k):
        counts["data checks"] += 1
        return check_data(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "read_text", count_read)
    monkeypatch.setattr(pathlib.Path, "read_bytes", count_read_bytes)
    monkeypatch.setattr(TokenData, "open", classmethod(count_open))
    monkeypatch.setattr(TokenData, "check", count_check)
    return counts


def test_each_set_up_step_runs_once(tmp_path_factory, tmp_path, counted):
    data = shared_data(tmp_path_factory)
    cfg = write_config(tmp_path / "c.toml", tiny_config(data, **{
        "train.max_steps": 4, "train.ckpt_interval": 2, "train.eval_interval": 2}))
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--no-progress"]) == 0
    assert counted["data opens"] == 1 and counted["data checks"] == 1, counted
    # as a run killed after its step-2 checkpoint: no final checkpoint, no summary
    shutil.rmtree(run / "ckpt" / "step_000004")
    (run / "ckpt" / "latest").write_text("step_000002\n")
    (run / "summary.json").unlink()
    for k in counted:
        counted[k] = 0
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert counted == {"config.toml reads": 1, "data opens": 1, "data checks": 1}, counted
