"""Experiment commands: `nlq report RUN_DIR...` (statistics, report.md/json and Fig. 1)."""

from __future__ import annotations

from pathlib import Path

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


# name: (help, add_arguments, run); `nlq reproduce` joins here.
COMMANDS = {
    "report": ("statistics over seeds, report.md/json and Fig. 1 from finished runs",
               add_report_arguments, run_report),
}
