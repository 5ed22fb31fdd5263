"""--launcher slurm's settings: `--slurm FILE`, a TOML file whose [slurm] table holds the
cluster's settings, every key checked (SLURM_KEYS). nlq/experiments/slurm.py submits the runs
with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nlq.errors import NlqError, short

if TYPE_CHECKING:
    from nlq.experiments.slurm import Slurm

# The keys of --slurm FILE's [slurm] table: the submitit parameter each one sets
# (AutoExecutor.update_parameters; a generic name applies to both executors, a slurm_ one to
# Slurm alone), or None for nlq's own. Anything else is refused, naming the allowed keys.
SLURM_KEYS: dict[str, str | None] = {
    "executor": None,  # "slurm" (default) or "local": submitit's LocalExecutor, on this machine
    "folder": None,  # submitit's job files and logs (default OUT/slurm; relative: to OUT)
    "array_parallelism": None,  # --jobs auto: the most runs submitted at once (default 256)
    "max_num_timeout": None,  # requeues after a time limit before a run is failed (default 3)
    "partition": "slurm_partition",
    "timeout_min": "timeout_min",  # each job's time limit; a longer run is requeued, resumed
    "gpus_per_node": "gpus_per_node",
    "cpus_per_task": "cpus_per_task",  # default: the run's threads (at least those)
    "mem_gb": "mem_gb",
    "account": "slurm_account",
    "qos": "slurm_qos",
    "constraint": "slurm_constraint",
    "exclude": "slurm_exclude",
    "signal_delay_s": "slurm_signal_delay_s",  # the time-limit warning's lead (default 90)
    "setup": "setup",  # shell lines a Slurm job runs first (module load ..., source ...)
    "additional_parameters": "slurm_additional_parameters",  # any other sbatch option
}
# what a job submitted to a real cluster must say: where it goes and for how long (submitit's
# own default time limit, 5 minutes, would end any real run)
SLURM_REQUIRED = ("partition", "timeout_min")
_STR_KEYS = ("executor", "folder", "partition", "account", "qos", "constraint", "exclude")
_COUNT_KEYS = ("array_parallelism", "max_num_timeout", "timeout_min", "gpus_per_node",
               "cpus_per_task", "signal_delay_s")
LOCAL_TIMEOUT_MIN = 60 * 24 * 365  # executor = "local" without timeout_min: no time limit


@dataclass
class SlurmSettings:
    """--slurm FILE's [slurm] table, checked; what --launcher slurm passes down to run_all."""

    path: Path
    folder: Path
    params: dict = field(default_factory=dict)  # the table's SLURM_KEYS, as given
    name: str = "slurm"

    @property
    def executor(self) -> str:
        return self.params.get("executor", "slurm")

    @property
    def jobs(self) -> int:
        """--jobs auto: runs submitted at once."""
        return self.params.get("array_parallelism", 256)

    def submitit_parameters(self) -> dict:
        """The table as AutoExecutor.update_parameters keywords for this executor."""
        out = {}
        for key, value in self.params.items():
            name = SLURM_KEYS[key]
            if name == "setup":  # the cluster's nodes only: locally the jobs run in this
                name = "slurm_setup" if self.executor == "slurm" else None  # environment
            if name is not None:
                out[name] = dict(value) if isinstance(value, dict) else value
        if self.executor == "local":
            out.setdefault("timeout_min", LOCAL_TIMEOUT_MIN)
        return out

    def launcher(self, jobs: int) -> Slurm:
        """The launcher of these settings (launch.make_launcher), `jobs` submitted at once."""
        from nlq.experiments.slurm import Slurm  # submitit's side, loaded when it is used

        return Slurm(self, jobs)


def slurm_settings(path: str | Path, out: Path) -> SlurmSettings:
    """Read and check --slurm FILE (its [slurm] table) for a command writing to `out`: an
    unknown key, a missing required one or a bad value is one NlqError naming it."""
    from nlq.config.load import loads

    path = Path(path)
    where = f"--slurm {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NlqError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise NlqError(f"{where}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    raw = loads(text, where)
    table = raw.get("slurm")
    if not isinstance(table, dict):
        raise NlqError(f"{where}: no [slurm] table (e.g. [slurm] partition = \"gpu\", "
                       f"timeout_min = 240)")
    other = sorted(set(raw) - {"slurm"})
    if other:
        raise NlqError(f"{where}: unknown table or key {other[0]!r} outside [slurm]: the file "
                       f"holds the [slurm] table alone")
    unknown = sorted(set(table) - set(SLURM_KEYS))
    if unknown:
        raise NlqError(f"{where}: [slurm] unknown key {unknown[0]!r} (allowed: "
                       f"{', '.join(SLURM_KEYS)})")
    for key, value in table.items():
        _check_slurm_value(where, key, value)
    executor = table.get("executor", "slurm")
    if executor not in ("slurm", "local"):
        raise NlqError(f"{where}: [slurm] executor must be \"slurm\" or \"local\", got "
                       f"{short(executor)}")
    missing = [k for k in SLURM_REQUIRED if k not in table] if executor == "slurm" else []
    if missing:
        raise NlqError(f"{where}: [slurm] needs {missing[0]!r} (required with executor = "
                       f"\"slurm\": {', '.join(SLURM_REQUIRED)})")
    folder = Path(table.get("folder", "slurm"))
    return SlurmSettings(path=path, folder=folder if folder.is_absolute() else out / folder,
                         params=dict(table))


def _check_slurm_value(where: str, key: str, value) -> None:
    bad = None
    if key in _STR_KEYS:
        if not isinstance(value, str) or not value.strip():
            bad = "a non-empty string"
    elif key in _COUNT_KEYS:
        least = 0 if key in ("gpus_per_node", "max_num_timeout") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            bad = f"a whole number >= {least}"
    elif key == "mem_gb":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            bad = "a number of GB > 0"
    elif key == "setup":
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            bad = "a list of shell lines (strings)"
    elif key == "additional_parameters" and (not isinstance(value, dict) or not all(
            isinstance(v, (str, int, float, bool)) for v in value.values())):
        bad = "a table of sbatch options (name = value)"
    if bad:
        raise NlqError(f"{where}: [slurm] {key} must be {bad}, got {short(value)}")
