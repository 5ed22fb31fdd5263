"""Experiment commands: `nlq reproduce` (the paper's comparison end to end) and
`nlq report RUN_DIR...` (statistics, report.md/json and Fig. 1 from finished runs)."""

from __future__ import annotations

import os
from pathlib import Path

# ---------------------------------------------------------------------------------------
# nlq reproduce


def add_reproduce_arguments(p) -> None:
    p.add_argument("--experiment", default="paper", metavar="NAME|FILE",
                   help="shipped experiment (paper, strong-baseline, encoder) or a TOML file "
                        "(default: paper)")
    p.add_argument("--preset", default="tiny", help="tiny (CPU, embedded corpus; default) or "
                   "gpt3-small (the paper's configuration)")
    p.add_argument("--seeds", type=int, default=2, help="model-init seeds per arm (default 2)")
    p.add_argument("--arms", default=None, metavar="A,B,...",
                   help="run only these arms (the baseline is always added)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output dir (default: out/<experiment>-<preset>)")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs trained at once (default: 2 on a CPU with >= 2 cores, else 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every arm, e.g. train.max_steps=100")
    p.add_argument("--force", action="store_true",
                   help="train gpt3-small even where no GPU is present")


def run_reproduce(args) -> int:
    import torch

    from nlq.config import parse_sets
    from nlq.errors import NlqError
    from nlq.experiments.reproduce import reproduce

    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    jobs = args.jobs
    if jobs is None:
        jobs = 2 if not torch.cuda.is_available() and (os.cpu_count() or 1) >= 2 else 1
    if jobs < 1:
        raise NlqError(f"--jobs must be >= 1, got {jobs}")
    exp_name = Path(args.experiment).stem
    out = Path(args.out or f"out/{exp_name}-{args.preset}")
    return reproduce(args.experiment, args.preset, args.seeds, arms, out, jobs, args.force,
                     parse_sets(args.set))


# ---------------------------------------------------------------------------------------
# nlq report


def add_report_arguments(p) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run folders, or experiment folders holding runs/<arm>/seed<k>/")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where report.md, report.json and fig1.png go (default: the one "
                        "RUN_DIR when it is an experiment folder, else ./report)")
    p.add_argument("--baseline", default="linear", metavar="ARM",
                   help="arm every other arm is compared to (default: linear)")
    p.add_argument("--title", default=None, help="report title (default: from the folder)")


def run_report(args) -> int:
    from nlq.eval.report import build_report

    dirs = [Path(d) for d in args.run_dirs]
    single_exp = len(dirs) == 1 and dirs[0].is_dir() and not (dirs[0] / "config.toml").exists()
    out = Path(args.out) if args.out else (dirs[0] if single_exp else Path("report"))
    title = args.title or (f"nlq report: {dirs[0].resolve().name}" if single_exp else "nlq report")
    rep = build_report(dirs, out, baseline=args.baseline, title=title)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}, {out / 'fig1.png'}")
    print(f"{rep['measured']['n_finished_runs']} finished run(s), {len(rep['incomplete'])} "
          f"incomplete (excluded)")
    for row in rep["arms"]:
        if "verdict" in row:
            print(f"- {row['verdict']}")
    if rep["ordering"] and rep["ordering"]["testable"]:
        print(f"- {rep['ordering']['answer']}")
    for s in rep["strong_baseline"]:
        print(f"- {s['answer']}")
    return 0


# name: (help, add_arguments, run)
COMMANDS = {
    "reproduce": ("the paper's comparison: train every arm x seed, then report",
                  add_reproduce_arguments, run_reproduce),
    "report": ("statistics over seeds, report.md/json and Fig. 1 from finished runs",
               add_report_arguments, run_report),
}
