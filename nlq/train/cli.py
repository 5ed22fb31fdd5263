"""`nlq train`: train one config into a run dir, or resume one; several configs that differ
only in their seeds train as one stacked model into one run dir each (nlq/train/stack.py).

Process-wide tuning belongs to the command, not to the library: on CPU the command asks
train() to fix glibc's malloc thresholds (nlq/train/alloc.py) for the rest of the process
(tune_alloc=True). Code that calls nlq.train.loop.train() itself passes tune_alloc=True, or
calls nlq.train.alloc.keep_freed_memory(), where it wants the same.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nlq import runfiles
from nlq.config import load_config, parse_sets
from nlq.errors import NlqError


def add_arguments(p) -> None:
    p.add_argument("config", nargs="*",
                   help="a TOML config file or a preset name (tiny, ...); several configs "
                        "equal but for train.seed and data.seed train as one stacked model, "
                        "in lockstep, one run dir each (faster for small models on a GPU)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. --set train.lr=3e-4 (repeatable; every config)")
    p.add_argument("--out", nargs="+", metavar="DIR",
                   help="run dir, one per config (default: runs/<config name>)")
    p.add_argument("--resume", nargs="+", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR exactly where its last checkpoint left it "
                        "(several: a stack's runs, together)")
    p.add_argument("--stacked", action="store_true",
                   help="train as a stack even one config (the stacked recipe: the plain model "
                        "under vmap), as a study's stacked rung trains a seed left on its own")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (on a terminal it redraws every 0.1 s, into a file "
                        "or pipe every 30 s)")


def run(args) -> int:
    from nlq.train.loop import train

    if args.resume:
        if args.config or args.set or args.out:
            raise NlqError("--resume RUN_DIR takes no config, --set or --out: the run dir's "
                           "config.toml is used as written")
        run_dirs = [Path(d) for d in args.resume]
        for run_dir in run_dirs:
            if not (run_dir / runfiles.CONFIG).is_file():
                raise NlqError(f"{run_dir} is not an nlq run dir (no config.toml): nothing to "
                               f"resume")
        cfgs = None  # train() reads the run's config.toml, once, under the run's lock
    else:
        if not args.config:
            raise NlqError("give a config (TOML file or preset name) or --resume RUN_DIR")
        if args.out and len(args.out) != len(args.config):
            raise NlqError(f"--out names {len(args.out)} run dir(s) for {len(args.config)} "
                           f"config(s): give one per config")
        sets = parse_sets(args.set)
        cfgs = [load_config(c, sets) for c in args.config]
        run_dirs = [Path(d) for d in args.out or [f"runs/{Path(c).stem}" for c in args.config]]
    # tune_alloc: no page faults on per-step CPU buffers (nlq/train/alloc.py)
    if len(run_dirs) > 1 or args.stacked:
        from nlq.train.stack import train_stack

        summaries = train_stack(cfgs, run_dirs, resume=bool(args.resume),
                                progress=not args.no_progress, tune_alloc=True)
        for s in summaries:
            print(json.dumps(s))
        return 0
    summary = train(cfgs and cfgs[0], run_dirs[0], resume=bool(args.resume),
                    progress=not args.no_progress, tune_alloc=True)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary))
    return 0  # finished, or stopped cleanly by SIGINT/SIGTERM after a checkpoint


COMMANDS = {"train": ("train a config (or --resume a run dir)", add_arguments, run)}
