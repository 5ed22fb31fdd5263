"""Writing a run dir (its layout: nlq/runfiles.py): config.toml, metrics.jsonl, tb/, ckpt/
(nlq/run/checkpoint.py), summary.json, test_docs.json, and a lock so two processes never write one run. Rank 0 alone writes it.

A new run goes into a new or empty folder, or one holding only what `nlq reproduce` puts
there before it starts a run (arm.json, train.log) and the `.lock` of a killed start: a folder
holding anything else is someone else's, and is refused untouched. A run exists once it has
started, that is once it is set up (model, data, optimizer): its config.toml is written then,
and a start that fails before removes what it created (never what was there before), so the
corrected command can use the same --out. A run that fails later (a NaN at step 1) exists:
`--resume` continues it. nlq never writes a file of a run dir through a symlink (O_NOFOLLOW;
O_EXCL where it creates one); ckpt/ and tb/ may be symlinked folders (on a larger disk).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from pathlib import Path

from nlq import runfiles
from nlq.config import Config, load_config
from nlq.errors import NlqError
from nlq.fsutil import Locked, lock, unlock, write_atomic
from nlq.run import checkpoint

# What may be in a folder before a new run starts there: `nlq reproduce` writes arm.json and
# opens train.log before it starts `nlq train`; a start killed before its config.toml leaves
# .lock (holding its pid; empty when an earlier nlq wrote it).
BEFORE_START = (runfiles.ARM, runfiles.TRAIN_LOG, runfiles.LOCK)


class RunDir:
    """The run dir's open files: the lock, the metrics rows and the tensorboard events."""

    def __init__(self, path: Path, main: bool):
        self.path, self.main = path, main
        self.metrics_path = path / runfiles.METRICS
        self._metrics = None
        self._tb = None
        self._wandb = None
        self._lock_fd: int | None = None
        self._before: set[str] | None = None  # a new run: the names there before it started
        self._made: Path | None = None  # a new run: the outermost folder its start made
        self._started = False  # a new run: its config.toml is written

    def lock(self) -> None:
        """Hold RUN/.lock until close(); a second process on the run dir is refused."""
        path = self.path / runfiles.LOCK
        try:
            self._lock_fd = lock(path)
        except Locked as e:
            raise NlqError(f"another `nlq train` is running on {self.path} (process {e.pid} "
                           f"holds {path}); wait for it or use another --out") from None
        except OSError as e:  # a read-only dir, a file where the dir should be, a symlink
            if e.errno == errno.ELOOP:
                raise NlqError(f"{path} is a symbolic link: nlq never writes through one "
                               f"(remove it if it is yours)") from None
            raise NlqError(f"cannot write run dir {self.path}: {e.strerror or e}") from None

    def create(self) -> None:
        """A new run: refuse a folder that holds a run or files that are not nlq's, make the
        folder, lock it, and note what was there (close(failed=True) removes the rest)."""
        d = self.path
        if d.is_dir():
            names = os.listdir(d)
            if runfiles.CONFIG not in names and runfiles.CKPT not in names:
                foreign = [n + (" (a symbolic link)" if (d / n).is_symlink() else "")
                           for n in sorted(names) if not _before_start(d / n)]
                if foreign:
                    more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
                    raise NlqError(
                        f"--out {d} is not empty and is not an nlq run dir (it holds "
                        f"{', '.join(foreign[:3])}{more}): a new run goes into a new or empty "
                        f"folder; choose another --out")
        made = None if d.exists() or d.is_symlink() else d
        while made is not None and not made.parent.exists() and made.parent != made:
            made = made.parent
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise NlqError(f"cannot write run dir {d}: {e.strerror or e}") from None
        self._made = made
        self.lock()
        if (d / runfiles.CKPT).exists() or (d / runfiles.CONFIG).exists():
            raise NlqError(f"run dir {d} already holds a run: continue it with "
                           f"`nlq train --resume {d}` or choose another --out")
        self._before = set(os.listdir(d))

    def write_config(self, cfg: Config) -> None:
        """The resolved config, written once the run is set up: from here on it exists."""
        write_atomic(self.path / runfiles.CONFIG, cfg.to_toml())
        self._started = True

    def open_logs(self, truncate_to: int | None, step: int) -> None:
        """Open metrics.jsonl for appending and the tensorboard writer. A resumed run passes
        the metrics size its checkpoint recorded: what was written after it is dropped."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
        if truncate_to is None:
            flags |= os.O_EXCL  # a new run: the file is its own to create
        try:
            fd = os.open(self.metrics_path, flags, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise NlqError(f"{self.metrics_path} is a symbolic link: nlq never writes "
                               f"through one (remove it if it is yours)") from None
            raise
        if truncate_to is not None and os.fstat(fd).st_size > truncate_to:
            # drop the lines written after the checkpoint we resume from
            os.ftruncate(fd, truncate_to)
        self._metrics = os.fdopen(fd, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            purge = step if truncate_to is not None else None  # resumed: drop later events
            self._tb = SummaryWriter(str(self.path / runfiles.TB), purge_step=purge)
        except ImportError:  # tensorboard is optional at run time
            self._tb = None

    def open_wandb(self, project: str, config: dict) -> None:
        """Mirror every row to W&B too (train.wandb_project; nlq/train/wandb_log.py)."""
        from nlq.train.wandb_log import WandbLog

        self._wandb = WandbLog(project, self.path, config)

    def log(self, row: dict) -> None:
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._wandb is not None:
            self._wandb.log(row)
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("kind", "step") and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{row['kind']}/{k}", v, row["step"])

    def metrics_bytes(self) -> int:
        """The size of metrics.jsonl, every row on disk: what a checkpoint records."""
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        return os.fstat(self._metrics.fileno()).st_size

    def close(self, failed: bool = False) -> None:
        """Close the logs and release the lock. failed: a new run that ended in an error before
        it started (write_config) is undone: what its start created is removed."""
        for f in (self._metrics, self._tb, self._wandb):
            if f is not None:
                # on a full disk a close may fail to flush; the error that got us here is
                # the one to report (metrics rows are flushed as they are written)
                with contextlib.suppress(OSError):
                    f.close()
        undo = failed and self._before is not None and not self._started
        if undo:  # under the lock: no other process is writing here
            for name in sorted(set(os.listdir(self.path)) - self._before - {runfiles.LOCK}):
                p = self.path / name
                with contextlib.suppress(OSError):
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p)
                    else:
                        p.unlink()
        if self._lock_fd is not None:
            unlock(self.path / runfiles.LOCK, self._lock_fd)  # removes .lock
            self._lock_fd = None
        if undo and self._made is not None:  # the folders this start made, if now empty
            d = self.path
            while True:
                try:
                    d.rmdir()
                except OSError:
                    break
                if d == self._made:
                    break
                d = d.parent


def _before_start(p: Path) -> bool:
    """Whether p is a file nlq puts in a run dir before its run starts (BEFORE_START): a
    plain file (never a symlink), and a .lock holding at most a pid."""
    if p.name not in BEFORE_START or p.is_symlink() or not p.is_file():
        return False
    if p.name != runfiles.LOCK:
        return True
    try:
        text = p.read_bytes()[:65]
    except OSError:
        return False
    return len(text) <= 64 and (text.strip().isdigit() or not text.strip())


def finished(run_dir: Path, main: bool) -> dict | None:
    """--resume of a finished run: its summary (the resume has nothing to do). A summary.json
    that is not a finished run's is ignored with a warning: the resume continues from the last
    checkpoint (the final one recomputes only its evaluation) and writes it again."""
    summary, why = runfiles.read_summary(run_dir)
    if why is not None and main:
        print(f"nlq: warning: {run_dir / runfiles.SUMMARY} {why}: ignored; resuming from the "
              f"last checkpoint writes it again", file=sys.stderr)
    if summary is not None:  # nothing to train, but config.toml must still be the run's
        cfg = read_run_config(run_dir)  # an unreadable or unknown key is an error here too
        dirs = checkpoint.step_dirs(run_dir)
        try:
            state = json.loads((dirs[max(dirs)] / "state.json").read_text()) if dirs else {}
        except (OSError, ValueError):
            state = {}
        rec = state.get("depends") if isinstance(state, dict) else None
        if isinstance(rec, dict) and isinstance(rec.get("config"), dict):
            checkpoint.check_config(rec["config"], cfg.to_dict(), dirs[max(dirs)], run_dir)
    return summary


def prepare_run_dir(cfg: Config | None, run: RunDir, resume: bool) -> Config:
    """Resume: lock the run dir and read its config, the one read of config.toml in a
    resume. New run: make and lock the run dir (RunDir.create; the caller has checked the
    data), and the config is written once set up."""
    run_dir, cfg_path = run.path, run.path / runfiles.CONFIG
    if resume:
        if not cfg_path.is_file():
            raise NlqError(f"{run_dir} is not an nlq run dir (no config.toml): nothing to resume")
        run.lock()
        return read_run_config(run_dir)
    run.create()
    return cfg


def read_run_config(run_dir: Path) -> Config:
    """RUN/config.toml as a Config (an error names the file)."""
    return load_config(Path(run_dir) / runfiles.CONFIG)
