"""The report of an experiment: report.json (nlq.report.summary), report.md (nlq.report.markdown)
and Fig. 1 (nlq.report.figure) from run folders (nlq.report.runs; numerical replicates among them
are read as such, nlq.report.noise), and the lines both `nlq report` and `nlq reproduce` print.

What the experiment declares (its expected ordering, the paper's figures) comes from
nlq.report.claims: passed in, or read from the experiment.toml that `nlq reproduce` writes.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from nlq.errors import NlqError
from nlq.report.claims import Claims, find_claims
from nlq.report.figure import draw_fig1
from nlq.report.markdown import answer_lines, render_markdown
from nlq.report.markdown_noise import machine_answer
from nlq.report.runs import Run, collect
from nlq.report.summary import summarize


def build_report(runs: Sequence[str | Path] | Sequence[Run], out_dir: str | Path,
                 baseline: str = "linear", title: str = "nlq report",
                 claims: Claims | None = None) -> dict:
    """Write report.md, report.json and fig1.png into out_dir; return report.json's content.
    runs: run/experiment folders, or the output of collect(). claims: None to read them from
    an experiment.toml in the folders given or above the run dirs."""
    runs = list(runs)
    if not runs:
        raise NlqError("no run dirs given")
    given = [] if all(isinstance(r, Run) for r in runs) else [Path(r) for r in runs]
    if given:
        runs = collect(given)
    if claims is None:
        claims = find_claims(given, [r.dir for r in runs])
    rep = summarize(runs, baseline=baseline, title=title, claims=claims)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NlqError(f"--out {out} is a file: give a folder for report.md, report.json and "
                       f"fig1.png")
    lrs = [p / "lrs.json" for p in [out, *given] if (p / "lrs.json").is_file()]
    rep["lrs"] = read_lrs(lrs[0]) if lrs else None
    out.mkdir(parents=True, exist_ok=True)
    _relative_run_dirs(rep, out)
    draw_fig1(runs, rep, out / "fig1.png")
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(render_markdown(rep), encoding="utf-8")
    return rep


def read_lrs(path: Path) -> dict | None:
    """lrs.json (`nlq reproduce --lrs-from`: each arm's lr and the sweep that chose it), or
    None with a warning when it is not that: the report shows it, and needs it for nothing
    else (each run's config.toml holds the lr it trained with)."""
    try:
        lrs = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        why = f"is not valid JSON ({e})" if isinstance(e, ValueError) else str(e)
    else:
        if isinstance(lrs, dict) and isinstance(lrs.get("lrs"), dict) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool)
                for v in lrs["lrs"].values()) and isinstance(lrs.get("source"), str) and \
                isinstance(lrs.get("commit"), (str, type(None))):
            return lrs
        why = "is not what `nlq reproduce --lrs-from` writes (source, commit, lrs per arm)"
    print(f"nlq: warning: {path} {why}: not shown in the report", file=sys.stderr)
    return None


def _relative_run_dirs(obj, out: Path) -> None:
    """Run dirs as paths relative to the report's folder, so a report committed with its runs
    (`nlq export`) names no path of the machine that made it."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "run_dir" and isinstance(v, str):
                obj[k] = os.path.relpath(Path(v).resolve(), out.resolve())
            else:
                _relative_run_dirs(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _relative_run_dirs(v, out)


def summary_lines(rep: dict) -> list[str]:
    """The report's answers, one line each: what stops a verdict, the verdicts of the Holm
    family and what is read from them, what is only described, rounding and convergence."""
    head = [x for x in (rep.get("rounding_line"), rep.get("first_line")) if x]
    judged, described = answer_lines(rep)
    if not rep.get("verdicts_allowed", True):
        return head + ["Differences (descriptive only, no verdict):"] + [
            f"- {d}" for d in described]
    lines = head + [f"- {v}" for v in judged]
    if described:
        lines += ["Described (outside the pre-registered comparisons, no verdict):"] + [
            f"- {d}" for d in described]
    share = (rep.get("numerical_noise") or {}).get("share_answer")
    machines = machine_answer(rep)
    conv = (rep.get("convergence") or {}).get("answer")
    return lines + [x for x in (share, machines, conv) if x]


def print_summary(rep: dict) -> None:
    print("\n".join(summary_lines(rep)))
