"""One writer for every benchmark's result file (benchmarks/results/).

A file is named <bench>-<date>-<commit>.json (date in UTC, the commit's short sha), with a
-2, -3, ... suffix when that name is taken: a result is never overwritten, so every figure in
RESULTS.md keeps its raw data. Every file holds the same keys (KEYS):

    bench     the script, e.g. "train_bench"
    date      when the run started, ISO 8601 in UTC
    commit    the full sha of HEAD
    dirty     whether tracked files differed from HEAD (uncommitted code was measured); false
              for a copied tree whose clean commit NLQ_BENCH_COMMIT named
    command   the command line
    hardware  cpu model, cores, machine, python and torch versions, CUDA device (or null)
    results   the bench's own figures and settings

A run from a tree with uncommitted changes is refused before it measures anything, unless
--allow-dirty is given, which records dirty = true: a figure must name the code it timed.
Edits under benchmarks/results/ and to benchmarks/RESULTS.md do not count; they are records,
not timed code.

    rec = record.Recorder("train_bench", args)   # args from record.add_arguments(parser)
    ...                                           # measure
    path = rec.write({"mode": ..., "rows": rows})
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from nlq.sysinfo import cpu_name

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
KEYS = ("bench", "date", "commit", "dirty", "command", "hardware", "results")
NOT_CODE = ("benchmarks/results", "benchmarks/RESULTS.md")  # records, not timed code


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--allow-dirty", action="store_true",
                    help="record even with uncommitted changes (the file is marked dirty)")
    ap.add_argument("--results-dir", default=str(RESULTS_DIR),
                    help="folder of the result file (default benchmarks/results)")


def git_state(root: Path = ROOT) -> tuple[str, bool]:
    """(sha of HEAD, whether tracked files outside NOT_CODE differ from it); where
    NLQ_BENCH_COMMIT is set, (it, False): the sender's word that the tree is that commit."""
    def git(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, check=False)

    if os.environ.get("NLQ_BENCH_COMMIT"):
        # a copy of a checkout whose .git is missing or not the tree's (e.g. a tree sent to a
        # GPU machine): the sender names the clean commit the tree is a copy of
        return os.environ["NLQ_BENCH_COMMIT"], False
    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        raise SystemExit(f"record: {root} is not a git checkout; a result must name its commit "
                         f"(or set NLQ_BENCH_COMMIT to the clean commit a copied tree is)")
    excludes = [f":(exclude,top){p}" for p in NOT_CODE]
    status = git("status", "--porcelain", "--untracked-files=no", "--", ":/", *excludes)
    return head.stdout.strip(), bool(status.stdout.strip())


def hardware() -> dict:
    import torch

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    if script.is_relative_to(ROOT):
        script = script.relative_to(ROOT)
    return shlex.join(["python", str(script), *argv[1:]])


def free_path(folder: Path, stem: str) -> Path:
    """folder/stem.json, or stem-2.json, stem-3.json, ... whichever is not taken yet."""
    n = 1
    while True:
        path = folder / f"{stem}{'' if n == 1 else f'-{n}'}.json"
        if not path.exists():
            return path
        n += 1


class Recorder:
    """Checks the tree when a run starts (refusing a dirty one unless allowed), writes the
    result file when it ends."""

    def __init__(self, bench: str, args: argparse.Namespace, root: Path = ROOT):
        self.bench, self.folder = bench, Path(args.results_dir)
        self.commit, self.dirty = git_state(root)
        if self.dirty and not args.allow_dirty:
            raise SystemExit(
                f"{bench}: the git tree has uncommitted changes, so the result could not name "
                f"the code it measured; commit first, or pass --allow-dirty (the result file "
                f"is then marked dirty)")
        self.date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.command = command_line()

    def write(self, results: dict) -> Path:
        record = {"bench": self.bench, "date": self.date, "commit": self.commit,
                  "dirty": self.dirty, "command": self.command, "hardware": hardware(),
                  "results": results}
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            path = free_path(self.folder, f"{self.bench}-{self.date[:10]}-{self.commit[:7]}")
            try:
                with open(path, "x") as f:  # "x": never replaces a file that appeared meanwhile
                    f.write(json.dumps(record, indent=2) + "\n")
                break
            except FileExistsError:
                continue
        print(f"\nwrote {path} ({self.date}, commit {self.commit[:7]}"
              f"{' + uncommitted changes' if self.dirty else ''}, {record['hardware']['cpu']})")
        return path
