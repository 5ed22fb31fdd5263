"""An experiment's --out is its own: `nlq reproduce`, `sweep` and `study` refuse a folder
holding files nlq did not write (exit 2, one `nlq: error:` line naming them, nothing
changed), and a file given as a folder; a new, empty or earlier nlq folder is accepted."""

from __future__ import annotations

import pytest
from helpers import assert_user_error, nlq, ok, snapshot

COMMANDS = {
    "reproduce": ["reproduce", "--preset", "tiny", "--seeds", "2"],
    "sweep": ["sweep", "--preset", "tiny", "--lrs", "1e-3,2e-3,4e-3"],
    "study": ["study", "--dry-run"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_folder_of_the_users_is_refused_untouched(command, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes\n")
    (out / "thesis").mkdir()
    before = snapshot(out)
    p = nlq(*COMMANDS[command], "--out", str(out))
    assert_user_error(p, str(out), "notes.txt", "thesis", "did not write")
    assert p.returncode == 2
    assert snapshot(out) == before and sorted(x.name for x in out.iterdir()) == [
        "notes.txt", "thesis"]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_file_as_out_is_refused(command, tmp_path):
    f = tmp_path / "out.txt"
    f.write_text("x")
    assert_user_error(nlq(*COMMANDS[command], "--out", str(f)), str(f), "is a file")
    assert f.read_text() == "x"


def test_an_empty_folder_and_a_study_folder_are_accepted(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    ok(nlq("study", "--dry-run", "--out", str(empty)))
    rung = tmp_path / "study" / "S0"
    rung.mkdir(parents=True)
    (rung / "rung.json").write_text("{}")
    ok(nlq("study", "--dry-run", "--rungs", "S1", "--out", str(tmp_path / "study")))
