"""Experiment commands: `nlq params` (exact parameter counts of an experiment's arms),
`nlq reproduce` (the paper's comparison end to end), `nlq report RUN_DIR...` (statistics,
report.md/json and Fig. 1 from finished runs), `nlq sweep` (lr tuning) and `nlq export` (the
committable part of an output folder)."""

from __future__ import annotations

import json
from pathlib import Path

from nlq import runfiles
from nlq.errors import NlqError
from nlq.experiments.launch import LAUNCHERS
from nlq.report.claims import Claims
from nlq.sysinfo import check_threads, cores

# ---------------------------------------------------------------------------------------
# nlq params


def add_params_arguments(p) -> None:
    p.add_argument("--experiment", default="paper", metavar="NAME|FILE",
                   help="whose arms to count: a shipped experiment (paper, strong-baseline, "
                        "encoder) or a TOML file (default: paper)")
    p.add_argument("--preset", default="gpt3-small", help="preset name (default: gpt3-small)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every arm, e.g. model.n_layer=6")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_params(args) -> int:
    from nlq.config import parse_sets
    from nlq.experiments.experiment import params_table

    rows = params_table(args.experiment, args.preset, parse_sets(args.set))
    if args.json:
        keys = ("name", "query", "mlp_hidden", "total", "non_embedding", "vs_baseline_pct")
        print(json.dumps({"experiment": args.experiment, "preset": args.preset,
                          "arms": [{k: r[k] for k in keys} for r in rows]}))
        return 0
    base = next(r["name"] for r in rows if r["baseline"])
    print(f"experiment {args.experiment}, preset {args.preset}: non-embedding = total minus "
          f"token and position embeddings")
    print(f"| arm | MLP | total | non-embedding | vs {base} |")
    print("|---|---|---|---|---|")
    for r in rows:
        p = r["vs_baseline_pct"]
        vs = "-" if r["baseline"] else "0%" if p == 0 else f"{p:+.3f}%"
        name = r["name"].replace("+", " +") + " (computed)" if r["computed"] else r["name"]
        print(f"| {name} | {r['mlp_hidden']} | {r['total']:,} | "
              f"{r['non_embedding']:,} | {vs} |")
    for r in rows:
        for twin in r["same_model"]:
            print(f"{twin}: the model of {r['name']} (the arms differ in training only)")
    return 0


# ---------------------------------------------------------------------------------------
# nlq reproduce


def add_launch_arguments(p) -> None:
    """--jobs, --launcher and --slurm, shared by reproduce, sweep and study."""
    p.add_argument("--jobs", default="auto", metavar="N|auto",
                   help="runs trained at once (with --launcher gpus: per GPU; slurm: jobs "
                        "submitted at once); auto, the default: on a CPU its cores / "
                        "--threads, on a GPU as many as its memory holds (the runs' estimate) "
                        "and the CPU cores feed, on slurm the table's array_parallelism (256)")
    p.add_argument("--launcher", default="local", choices=LAUNCHERS,
                   help="how runs start: local (processes within the CPU thread budget, "
                        "the default), gpus (--jobs runs on each visible GPU, each child "
                        "seeing its own) or slurm (each run a job submitted through submitit; "
                        "needs --slurm FILE); nlq/experiments/launch.py")
    p.add_argument("--slurm", default=None, metavar="FILE",
                   help="with --launcher slurm: a TOML file whose [slurm] table holds the "
                        "cluster's settings (partition, timeout_min, gpus_per_node, "
                        "cpus_per_task, mem_gb, account, qos, constraint, setup, ...; "
                        "executor = \"local\" runs the jobs on this machine), every key checked")


def add_stack_argument(p) -> None:
    p.add_argument("--stack", type=int, default=1, metavar="K",
                   help="train up to K seeds of one arm (and lr) as one stacked model in one "
                        "process (nlq/train/stack.py: equal to lone runs to float rounding, "
                        "not bit for bit; for small models on a GPU, which a lone run leaves "
                        "launch-bound); default 1: every run alone. --jobs counts processes")


def check_stack(k: int) -> int:
    from nlq.errors import NlqError

    if k < 1:
        raise NlqError(f"--stack must be >= 1 (seeds trained as one model), got {k}")
    return k


def _launcher(args, out: Path):
    """--launcher as run_all takes it: its name, or for slurm the settings read from --slurm
    FILE (every key checked, submitit's job files under OUT/slurm by default); a --slurm
    without --launcher slurm, or the reverse, is an error. Before any work."""
    from nlq.errors import NlqError
    from nlq.experiments.slurm_settings import slurm_settings

    if args.slurm is not None and args.launcher != "slurm":
        raise NlqError(f"--slurm {args.slurm} is for --launcher slurm (this command's "
                       f"launcher is {args.launcher})")
    if args.launcher != "slurm":
        return args.launcher
    if args.slurm is None:
        raise NlqError("--launcher slurm needs --slurm FILE: a TOML file whose [slurm] table "
                       "holds the cluster's settings (partition, timeout_min, ...)")
    return slurm_settings(args.slurm, out)


def add_reproduce_arguments(p) -> None:
    add_stack_argument(p)
    p.add_argument("--experiment", default="paper", metavar="NAME|FILE",
                   help="shipped experiment (paper, strong-baseline, encoder) or a TOML file "
                        "(default: paper)")
    p.add_argument("--preset", default="tiny",
                   help="tiny (a quick CPU smoke run; default), small (the CPU setting where the "
                        "positive control can pass; the README's main command) or gpt3-small "
                        "(the paper's configuration)")
    p.add_argument("--seeds", type=int, default=2,
                   help="seeds per arm, each fixing init and data order in every arm "
                        "(>= 2; default 2)")
    p.add_argument("--arms", default=None, metavar="A,B,...",
                   help="run only these arms (the baseline is always added)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output dir (default: out/<experiment>-<preset>)")
    add_launch_arguments(p)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every arm, e.g. train.max_steps=100")
    p.add_argument("--force", action="store_true",
                   help="train gpt3-small even where no GPU is present")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="intra-op CPU threads of every run (default 1): a fixed count, so the "
                        "command sums floats in the same order on any machine of the same ISA; "
                        "recorded in each run's config and summary")
    p.add_argument("--replicates", type=int, default=0, metavar="K",
                   help="also train seeds 0..K-1 of every arm at --replicate-threads: "
                        "numerical replicates, whose differences the report shows as rounding "
                        "noise beside the seed noise (default 0)")
    p.add_argument("--replicate-threads", type=int, default=None, metavar="N",
                   help="thread count of the replicates (default 2; must differ from --threads)")
    p.add_argument("--lrs-from", default=None, metavar="SWEEP_JSON",
                   help="train each arm at the lr that `nlq sweep` chose for it on val (its "
                        "sweep.json; same preset and --set); written to OUT/lrs.json")


def _names(value: str | None, flag: str) -> list[str] | None:
    """A comma list of names; None when the flag is not given; an empty one is an error (it
    would read as "all")."""
    if value is None:
        return None
    names = [a.strip() for a in value.split(",") if a.strip()]
    if not names:
        raise NlqError(f"{flag} {value!r} names nothing: give names separated by commas, or "
                       f"leave {flag} out for all")
    return names


def run_reproduce(args) -> int:
    from nlq.config import parse_sets
    from nlq.experiments.reproduce import reproduce

    arms = _names(args.arms, "--arms")
    if args.replicate_threads is not None and not args.replicates:
        raise NlqError("--replicate-threads needs --replicates K (how many seeds to replicate)")
    threads = check_threads(args.threads, "--threads")
    rthreads = (check_threads(args.replicate_threads or 2, "--replicate-threads")
                if args.replicates else None)
    exp_name = Path(args.experiment).stem
    out = Path(args.out or f"out/{exp_name}-{args.preset}")
    launcher = _launcher(args, out)
    jobs = _jobs(args.jobs, threads, launcher)
    return reproduce(args.experiment, args.preset, args.seeds, arms, out, jobs, args.force,
                     parse_sets(args.set), Path(args.lrs_from) if args.lrs_from else None,
                     threads, args.replicates, rthreads, launcher, check_stack(args.stack))


# ---------------------------------------------------------------------------------------
# nlq sweep


def add_sweep_arguments(p) -> None:
    p.add_argument("--experiment", default="paper", metavar="NAME|FILE",
                   help="shipped experiment or a TOML file (default: paper)")
    p.add_argument("--preset", default="small", help="preset name (default: small)")
    p.add_argument("--arms", default=None, metavar="A,B,...",
                   help="sweep only these arms (the baseline is always added)")
    p.add_argument("--lrs", required=True, metavar="LR,LR,...",
                   help="the lr grid: at least 3 values rising in one constant step, x2 or "
                        "x sqrt(2), e.g. 6e-3,1.2e-2,2.4e-2 or 1e-2,1.414e-2,2e-2,2.828e-2")
    p.add_argument("--seeds", type=int, default=4,
                   help="seeds per arm and lr (>= 2; default 4), indices 1000 and up: never "
                        "a seed of `nlq reproduce`")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output dir (default: out/sweep-<experiment>-<preset>)")
    add_launch_arguments(p)
    add_stack_argument(p)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run, e.g. train.max_steps=100")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="intra-op CPU threads of every run (default 1): a fixed count, so the "
                        "command sums floats in the same order on any machine of the same ISA; "
                        "recorded in each run's config and summary")


def run_sweep(args) -> int:
    from nlq.config import parse_sets
    from nlq.errors import NlqError
    from nlq.experiments.sweep import sweep

    try:
        lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError:
        raise NlqError(f"--lrs {args.lrs!r}: give numbers separated by commas") from None
    arms = _names(args.arms, "--arms")
    out = Path(args.out or f"out/sweep-{Path(args.experiment).stem}-{args.preset}")
    threads = check_threads(args.threads, "--threads")
    launcher = _launcher(args, out)
    return sweep(args.experiment, args.preset, arms, lrs, args.seeds, out,
                 _jobs(args.jobs, threads, launcher), parse_sets(args.set), threads, launcher,
                 check_stack(args.stack))


def _jobs(jobs: str | int | None, threads: int = 1, launcher="local") -> int | None:
    """--jobs as a count, or None for "auto" on a GPU (sized from the runs' memory estimate
    once they are planned: nlq/experiments/plan.py auto_gpu_jobs); on a CPU auto is as
    many runs as the cores hold at `threads` each; on slurm (launcher: its SlurmSettings)
    the table's array_parallelism. The launcher is checked here too (--launcher gpus without
    a GPU, slurm without submitit or sbatch), before any work."""
    import torch

    from nlq.errors import NlqError
    from nlq.experiments.launch import make_launcher
    from nlq.experiments.slurm_settings import SlurmSettings

    make_launcher(launcher, 1, threads)
    if (jobs is None or jobs == "auto") and isinstance(launcher, SlurmSettings):
        return launcher.jobs
    if jobs is None or jobs == "auto":
        return None if torch.cuda.is_available() else max(1, cores() // threads)
    try:
        n = int(jobs)
    except (TypeError, ValueError):
        raise NlqError(f"--jobs must be a count >= 1 or auto, got {jobs!r}") from None
    if n < 1:
        raise NlqError(f"--jobs must be >= 1, got {n}")
    return n


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
    p.add_argument("--experiment", default=None, metavar="NAME|FILE",
                   help="the experiment whose ordering and reference figures the report checks "
                        "and shows (default: the experiment.toml that `nlq reproduce` wrote "
                        "into the folder; none: neither)")


def run_report(args) -> int:
    from nlq.experiments.experiment import load_experiment
    from nlq.report.report import build_report, print_summary

    dirs = [Path(d) for d in args.run_dirs]
    single_exp = len(dirs) == 1 and dirs[0].is_dir() and not (dirs[0] / runfiles.CONFIG).exists()
    out = Path(args.out) if args.out else (dirs[0] if single_exp else Path("report"))
    title = args.title or (f"nlq report: {dirs[0].resolve().name}" if single_exp else "nlq report")
    # "none": no experiment's claims (an empty Claims: no ordering, no paper, no family)
    claims = (None if not args.experiment else Claims() if args.experiment == "none"
              else load_experiment(args.experiment).claims)
    rep = build_report(dirs, out, baseline=args.baseline, title=title, claims=claims)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}, {out / 'fig1.png'}")
    print(f"{rep['measured']['n_finished_runs']} finished run(s), {len(rep['incomplete'])} "
          f"incomplete (excluded)")
    print_summary(rep)
    return 0


# nlq export


def add_export_arguments(p) -> None:
    p.add_argument("src", metavar="OUT_DIR", help="an `nlq reproduce` or `nlq sweep` output folder")
    p.add_argument("dest", metavar="DEST", help="where the committable copy goes, e.g. "
                   "results/paper-small")


def run_export(args) -> int:
    from nlq.report.export import export_results

    files = export_results(args.src, args.dest)
    size = sum(f.stat().st_size for f in files)
    runs = sum(f.name == runfiles.SUMMARY for f in files)
    if any(f.name == "study.json" for f in files):
        again = f"; `nlq report {args.dest}/<rung>/compare` rebuilds a rung's report"
    elif any(f.name == "report.json" for f in files):
        again = f"; `nlq report {args.dest}` rebuilds the report from them"
    else:
        again = ""
    print(f"wrote {len(files)} files ({size / 1e6:.2f} MB, {runs} runs) to {args.dest}{again}")
    return 0


# nlq study


def add_study_arguments(p) -> None:
    p.add_argument("--ladder", default=None, metavar="FILE",
                   help="the ladder TOML (default: nlq/experiments/ladder.toml)")
    p.add_argument("--rungs", default=None, metavar="R,R,...",
                   help="run only these rungs (default: every cpu rung of the ladder)")
    p.add_argument("--out", default="out/study", metavar="DIR",
                   help="output dir (default: out/study); one folder per rung")
    add_launch_arguments(p)
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="intra-op CPU threads of every run (default 1): a fixed count, so the "
                        "command sums floats in the same order on any machine of the same ISA; "
                        "recorded in each run's config and summary")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and its cost (measured here), train nothing")
    p.add_argument("--force", action="store_true",
                   help="train a cuda rung even where no GPU is present")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="also export the study into DIR (`nlq export`: no checkpoints): "
                        "each run as it finishes, the reports after each phase of each rung "
                        "and when it stops, so a study cut off by a time limit (even a kill) "
                        "has lost no finished run")


def run_study(args) -> int:
    from nlq.experiments.study import study

    names = _names(args.rungs, "--rungs")
    threads = check_threads(args.threads, "--threads")
    launcher = _launcher(args, Path(args.out))
    return study(args.ladder, names, Path(args.out), _jobs(args.jobs, threads, launcher),
                 args.force, args.dry_run, threads, launcher,
                 Path(args.export) if args.export else None)


# name: (help, add_arguments, run)
COMMANDS = {
    "params": ("print exact parameter counts of an experiment's arms", add_params_arguments,
               run_params),
    "reproduce": ("the paper's comparison: train every arm x seed, then report",
                  add_reproduce_arguments, run_reproduce),
    "report": ("statistics over seeds, report.md/json and Fig. 1 from finished runs",
               add_report_arguments, run_report),
    "sweep": ("tune each arm's lr alike on val (loss-vs-lr figure, sweep.json)",
              add_sweep_arguments, run_sweep),
    "study": ("the comparison at every rung of a ladder of model sizes, then a scale report",
              add_study_arguments, run_study),
    "export": ("copy a reproduce/sweep folder's results without checkpoints, to commit",
               add_export_arguments, run_export),
}
