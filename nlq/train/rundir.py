"""A run dir: config.toml, metrics.jsonl, tb/, ckpt/ (nlq/train/checkpoint.py), summary.json,
and a lock so two processes never write one run. Rank 0 alone writes it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from nlq.config import Config, config_from_toml
from nlq.data.schedule import TokenData
from nlq.errors import NlqError
from nlq.fsutil import write_atomic


class RunDir:
    """The run dir's open files: the lock, the metrics rows and the tensorboard events."""

    def __init__(self, path: Path, main: bool):
        self.path, self.main = path, main
        self.metrics_path = path / "metrics.jsonl"
        self._metrics = None
        self._tb = None
        self._lock = None

    def lock(self) -> None:
        try:
            # held open (and locked) until close(): the lock lives as long as the run
            self._lock = open(self.path / ".lock", "w")  # noqa: SIM115
        except OSError as e:  # a read-only dir, a file where the dir should be
            raise NlqError(f"cannot write run dir {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NlqError(f"another `nlq train` is running on {self.path} (it holds "
                           f"{self.path / '.lock'}); wait for it or use another --out") from None

    def open_logs(self, truncate_to: int | None, step: int) -> None:
        """Open metrics.jsonl for appending and the tensorboard writer. A resumed run passes
        the metrics size its checkpoint recorded: what was written after it is dropped."""
        if truncate_to is not None and self.metrics_path.exists():
            # drop the lines written after the checkpoint we resume from
            os.truncate(self.metrics_path, truncate_to)
        self._metrics = open(self.metrics_path, "a")  # noqa: SIM115 - open for the whole run
        try:
            from torch.utils.tensorboard import SummaryWriter

            purge = step if truncate_to is not None else None  # resumed: drop later events
            self._tb = SummaryWriter(str(self.path / "tb"), purge_step=purge)
        except ImportError:  # tensorboard is optional at run time
            self._tb = None

    def log(self, row: dict) -> None:
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("kind", "step") and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{row['kind']}/{k}", v, row["step"])

    def metrics_bytes(self) -> int:
        """The size of metrics.jsonl, every row on disk: what a checkpoint records."""
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        return self.metrics_path.stat().st_size

    def close(self) -> None:
        for f in (self._metrics, self._tb, self._lock):
            if f is not None:
                # on a full disk a close may fail to flush; the error that got us here is
                # the one to report (metrics rows are flushed as they are written)
                with contextlib.suppress(OSError):
                    f.close()  # closing the lock file releases the lock


def prepare_run_dir(cfg: Config, run: RunDir, resume: bool) -> Config:
    """Lock the run dir first (so a second process is told about the first one). New run:
    check the data, then create the dir and write the resolved config; a failed start leaves
    no run dir behind. Resume: read the config back."""
    run_dir, cfg_path = run.path, run.path / "config.toml"
    if resume:
        if not cfg_path.is_file():
            raise NlqError(f"{run_dir} is not an nlq run dir (no config.toml): nothing to resume")
        run.lock()
        return config_from_toml(cfg_path.read_text())
    TokenData.open(cfg.data.dir).check(cfg.model.vocab_size, cfg.model.block_size)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        run.lock()
        if (run_dir / "ckpt").exists() or cfg_path.exists():
            raise NlqError(f"run dir {run_dir} already holds a run: continue it with "
                           f"`nlq train --resume {run_dir}` or choose another --out")
        write_atomic(cfg_path, cfg.to_toml())
    except OSError as e:
        raise NlqError(f"cannot write run dir {run_dir}: {e.strerror or e}") from None
    return cfg
