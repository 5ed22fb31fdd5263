"""Robustness of `nlq prepare`: what it writes into, two at once, symlinked corpora, text that
is not Unicode, Ctrl-C and SIGKILL, and seeds out of range. Each runs as an `nlq` process
(a zygote child, conftest.py) on a few small text files and GPT-2's tokenizer (no training).

- a folder of other files is refused whole (even with --force) and stays byte-identical;
  symlinks planted where nlq writes are replaced, never written through;
- a second prepare on a DIR being written is refused at once, naming the first one's pid;
- a glob or folder with a symlink loop and a duplicate symlink gives each real file once;
- an escaped lone surrogate in .jsonl, bytes that are not UTF-8 in .txt or .parquet: one
  error line naming the file, never a traceback;
- Ctrl-C (SIGINT to the whole process group, as a terminal sends it): exit 130, one line,
  no traceback from any worker, the earlier data byte-identical;
- SIGKILL leaves *.tmp files and the lock file; the next run removes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import assert_user_error, freeze, ok, snapshot, wait_for

from nlq.data.prepare import LOCK, TMP_NAMES
from nlq.data.schedule import TokenData
from nlq.fsutil import create, lock, unlock, write_atomic

WORDS = " ".join(f"w{i} and the {i % 7} of it" for i in range(400))  # ~1,000 tokens


def corpus(d: Path, n: int = 6) -> Path:
    """n small documents: enough for train, val and test splits of one window each."""
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (d / f"{i}.txt").write_text(f"document {i}: {WORDS}\n")
    return d


def prepare(zygote, src, out, *args, **kw):
    return zygote.run("prepare", "--source", src, "--tokenizer", "gpt2", "--out", out,
                      "--val-fraction", "0.2", "--workers", "1", *args, **kw)


def n_docs(out: Path) -> int:
    meta = json.loads((out / "meta.json").read_text())
    return meta["train_docs"] + meta["val_docs"] + meta["test_docs"]


def leftovers(out: Path) -> list[str]:
    return sorted(n for n in (*TMP_NAMES, LOCK) if os.path.lexists(out / n))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return corpus(tmp_path_factory.mktemp("small") / "corpus")


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """~13 MB of text in 160 documents: GPT-2 takes seconds on it, long enough to signal a
    run mid-way."""
    d = tmp_path_factory.mktemp("big")
    text = " ".join(f"x{i * 7919 % 100003} y{i % 97}" for i in range(10_000))
    for i in range(160):
        (d / f"{i:03d}.txt").write_text(f"{i} {text}\n")
    return d


@pytest.fixture
def earlier(zygote, small, tmp_path) -> tuple[Path, dict]:
    """A finished data dir and its files."""
    out = tmp_path / "data"
    ok(prepare(zygote, small, out))
    return out, snapshot(out)


def start_big(zygote, big, out):
    """A prepare --force of the big corpus into out, once it is tokenizing (its workers
    started, train.bin.tmp open); asserted to be still running."""
    p = zygote.start("prepare", "--source", big, "--tokenizer", "gpt2", "--out", out,
                     "--workers", "2", "--force")
    wait_for(lambda: (out / "train.bin.tmp").exists() or p.poll() is not None,
             what="prepare to start tokenizing")
    assert p.poll() is None, p.wait().stderr
    return p


# -- what prepare writes into ---------------------------------------------------------------


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "--force"])
def test_folder_of_other_files_is_refused(zygote, small, tmp_path, force):
    """A non-empty folder that nlq did not prepare (someone's train.bin and tokenizer.json,
    no meta.json; or a meta.json that is not a data dir's): one line naming it, untouched."""
    for i, meta in enumerate((None, '{"name": "my run"}', "not json")):
        user = tmp_path / f"user{i}"
        user.mkdir()
        (user / "train.bin").write_bytes(b"my tokens")
        (user / "tokenizer.json").write_text('{"mine": true}')
        if meta is not None:
            (user / "meta.json").write_text(meta)
        before = snapshot(user)
        p = prepare(zygote, small, user, *force)
        assert p.returncode == 2
        assert_user_error(p, f"--out {user} holds other files and is not an nlq data dir",
                          "choose a new or empty folder")
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert snapshot(user) == before
        assert sorted(x.name for x in user.iterdir()) == sorted(before)  # nothing hidden added


def test_symlinks_where_nlq_writes_are_never_followed(zygote, small, earlier, tmp_path):
    """In a data dir, train.bin and every temp name nlq writes are symlinks to files
    outside: prepare --force (bpe, so tokenizer.json.tmp is written too) replaces the links
    and leaves the files they point to byte-identical."""
    out, _ = earlier
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("train.bin", *TMP_NAMES):
        target = outside / name
        target.write_bytes(b"precious " + name.encode())
        (out / name).unlink(missing_ok=True)
        (out / name).symlink_to(target)
    before = snapshot(outside)
    ok(prepare(zygote, small, out, "--force", "--tokenizer", "bpe:300"))
    assert snapshot(outside) == before
    assert not (out / "train.bin").is_symlink() and leftovers(out) == []
    TokenData.open(out).check(300, 16)


def test_second_prepare_is_refused_naming_the_first(zygote, big, earlier):
    """Two prepares on one DIR: the second fails at once with one line naming the first's
    pid and writes nothing; the first (frozen meanwhile) then finishes as if alone."""
    out, _ = earlier
    first = start_big(zygote, big, out)
    try:
        freeze(first)
        before = snapshot(out)
        t0 = time.monotonic()
        p = prepare(zygote, big, out, "--force")
        assert time.monotonic() - t0 < 30
        assert p.returncode == 2
        assert_user_error(p, f"{out} is being written by another nlq prepare (pid {first.pid})")
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert snapshot(out) == before
    finally:
        first.send_signal(signal.SIGCONT)
    ok(first.wait())
    assert n_docs(out) == 160 and leftovers(out) == []


def test_lock_held_by_this_process(zygote, small, tmp_path):
    """The same refusal while a new DIR's lock is held here: nothing else is created."""
    out = tmp_path / "new"
    out.mkdir()
    fd = lock(out / LOCK)
    try:
        p = prepare(zygote, small, out)
        assert_user_error(p, f"(pid {os.getpid()})")
        assert sorted(x.name for x in out.iterdir()) == [LOCK]
    finally:
        unlock(out / LOCK, fd)
    ok(prepare(zygote, small, out))
    assert leftovers(out) == []


# -- sources -----------------------------------------------------------------------------------


def test_symlink_loop_and_duplicates_give_each_file_once(zygote, tmp_path):
    """A corpus with a symlink loop (sub/loop -> ..), a second path to a folder (dup -> sub)
    and a symlink to a file: a glob and the folder each give the 6 real files, quickly."""
    src = corpus(tmp_path / "src", 3)
    corpus(src / "sub", 3)
    (src / "sub" / "loop").symlink_to("..")
    (src / "dup").symlink_to("sub")
    (src / "again.txt").symlink_to("0.txt")
    for i, spec in enumerate((f"{src}/**/*.txt", src)):
        t0 = time.monotonic()
        out = tmp_path / f"out{i}"
        ok(prepare(zygote, spec, out))
        assert time.monotonic() - t0 < 30
        assert n_docs(out) == 6


@pytest.mark.parametrize("name, body, names", [
    ("lone.jsonl", b'{"text": "ok"}\n{"text": "bad \\ud800 half"}\n',
     ("lone.jsonl line 2", "unpaired surrogate \\ud800")),
    ("latin1.txt", "Der B\u00e4r".encode("latin-1"), ("latin1.txt", "not UTF-8", "0xe4")),
    ("bad.parquet", None, ("bad.parquet", "not UTF-8")),
], ids=["lone surrogate in jsonl", "latin-1 txt", "bad bytes in parquet"])
def test_text_that_is_not_unicode_is_one_error_line(zygote, small, earlier, tmp_path, name,
                                                    body, names):
    out, before = earlier
    src = corpus(tmp_path / "src", 3)
    if body is None:  # parquet does not check that a string column holds UTF-8
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        raw = pa.array([b"fine", b"\xff\xfe"], type=pa.binary())
        col = pa.Array.from_buffers(pa.string(), 2, raw.buffers()[:3])
        pq.write_table(pa.table({"text": col}), src / name)
    else:
        (src / name).write_bytes(body)
    p = prepare(zygote, src, out, "--force")
    assert p.returncode == 2
    assert_user_error(p, str(src / name), *names)
    assert snapshot(out) == before


def test_surrogate_pairs_are_text(zygote, small, tmp_path):
    """A valid escaped pair (an emoji) is ordinary text."""
    src = corpus(tmp_path / "src", 3)
    (src / "emoji.jsonl").write_text('{"text": "smile \\ud83d\\ude00 ' + WORDS + '"}\n')
    ok(prepare(zygote, src, tmp_path / "out"))
    assert n_docs(tmp_path / "out") == 4


# -- signals ---------------------------------------------------------------------------------


def test_ctrl_c_is_one_line_and_leaves_the_data(zygote, big, earlier):
    """SIGINT to the process group mid-way (a terminal's Ctrl-C reaches every worker):
    exit 130, exactly one line, no traceback, the earlier data byte-identical."""
    out, before = earlier
    p = start_big(zygote, big, out)
    os.killpg(p.pid, signal.SIGINT)
    r = p.wait(timeout=60)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip() == f"nlq: interrupted; {out} left as before", r.stderr
    assert snapshot(out) == before


@pytest.mark.parametrize("group", [True, False], ids=["kill -9 all", "kill -9 the parent"])
def test_sigkill_leftovers_are_removed_by_the_next_run(zygote, big, small, tmp_path, group):
    """kill -9 of a prepare into a new DIR leaves its *.tmp files and lock; the next
    prepare there takes the folder as nlq's, removes them and finishes. Workers orphaned by
    killing the parent alone do not hold its lock."""
    out = tmp_path / "new"
    p = start_big(zygote, big, out)
    try:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
        if group:
            os.killpg(p.pid, signal.SIGKILL)
        assert "train.bin.tmp" in leftovers(out) and LOCK in leftovers(out)
        ok(prepare(zygote, small, out))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the orphaned workers
    assert leftovers(out) == []
    TokenData.open(out)


def test_stale_tmp_files_are_removed(zygote, small, earlier):
    """Temp files of a killed run in a finished data dir (one a run without a test split
    would not write again) are removed even when there is nothing to redo."""
    out, before = earlier
    for name in TMP_NAMES:
        (out / name).write_bytes(b"stale")
    p = ok(prepare(zygote, small, out))
    assert "already prepared" in p.stdout
    assert snapshot(out) == before


# -- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", ["-1", str(2**63), str(10**30)])
def test_seed_out_of_range(zygote, small, tmp_path, seed):
    p = prepare(zygote, small, tmp_path / "out", "--seed", seed)
    assert p.returncode == 2
    assert_user_error(p, f"--seed {seed} must be in [0, 2**63 - 1]")
    assert not (tmp_path / "out").exists()


def test_largest_seed(zygote, small, tmp_path):
    ok(prepare(zygote, small, tmp_path / "out", "--seed", str(2**63 - 1)))


def test_create_never_writes_through_a_symlink(tmp_path):
    """fsutil.create (every file nlq prepare writes): a symlink at the path is replaced by a
    new file; the file it pointed to is untouched."""
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    for name in ("x.tmp", ".meta.json.tmp"):
        (tmp_path / name).symlink_to(target)
    with create(tmp_path / "x.tmp") as f:
        f.write(b"new")
    write_atomic(tmp_path / "meta.json", "{}")
    assert target.read_bytes() == b"keep"
    assert (tmp_path / "x.tmp").read_bytes() == b"new" and not (tmp_path / "x.tmp").is_symlink()
    assert (tmp_path / "meta.json").read_text() == "{}"
