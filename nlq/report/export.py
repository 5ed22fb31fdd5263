"""What of an experiment, sweep or study folder is worth committing: everything a reader needs
to check the report and `nlq report` needs to rebuild it, and none of the weights.

Kept: the folder's experiment.toml, lrs.json, report.md/json, fig1.png and the sweep's
sweep.json/png and sweep-plan.json; per run, arm.json, config.toml, summary.json,
test_docs.json (the per-document and per-chunk test losses the bootstrap resamples) and
metrics.jsonl cut to its meta, eval and spike lines (the val curve of Fig. 1, the slopes of
the convergence check and the flags; the per-step train lines are ~400 kB a run). Left out:
checkpoints, TensorBoard files, locks, logs."""

from __future__ import annotations

import json
from pathlib import Path

from nlq import runfiles
from nlq.errors import NlqError
from nlq.fsutil import write_atomic

FOLDER_FILES = ("experiment.toml", "lrs.json", "report.md", "report.json", "fig1.png",
                "sweep.json", "sweep.png", "sweep-plan.json")
RUN_FILES = (runfiles.ARM, runfiles.CONFIG, runfiles.SUMMARY, runfiles.TEST_DOCS)
KEPT_METRICS = ("meta", "eval", "spike")


STUDY_FILES = ("study.md", "study.json", "scale.png")


def export_results(src: str | Path, dest: str | Path) -> list[Path]:
    """Copy src's committable files into dest (made if missing; files there are replaced);
    returns the files written. Only finished runs (summary.json present) are copied. A study
    folder (`nlq study`) is exported rung by rung: rung.json, sweep/ and compare/."""
    src, dest = Path(src), Path(dest)
    if dest.resolve() == src.resolve():
        raise NlqError(f"export into the folder itself ({src}): give another destination")
    if dest.exists() and not dest.is_dir():
        raise NlqError(f"the destination {dest} is a file: give a folder")
    if (src / "study.json").is_file():
        return _export_study(src, dest)
    if not (src / "runs").is_dir():
        raise NlqError(f"{src} holds no runs/ folder: not an experiment, sweep or study output")
    written = []
    dest.mkdir(parents=True, exist_ok=True)
    for name in FOLDER_FILES:
        if (src / name).is_file():
            written.append(_copy(src / name, dest / name))
    for summary in sorted((src / "runs").rglob(runfiles.SUMMARY)):
        written += _export_run_files(summary.parent, dest / summary.parent.relative_to(src))
    return written


def export_run(src: str | Path, run: str | Path, dest: str | Path) -> list[Path]:
    """Export one finished run of output folder src (an experiment, sweep or study) into
    dest, where `nlq export src dest` puts it, with the plan files of the folders above it
    (rung.json, sweep-plan.json, experiment.toml, ...) so that dest continues the command on
    a fresh clone; a run without a summary is left out (returns [])."""
    src, run, dest = Path(src).resolve(), Path(run).resolve(), Path(dest)
    if not (run / runfiles.SUMMARY).is_file():
        return []
    rel = run.relative_to(src)
    written = []
    for folder in reversed(rel.parents):  # src ("."), then down to the run's parent
        for name in (*FOLDER_FILES, "rung.json"):
            if (src / folder / name).is_file():
                (dest / folder).mkdir(parents=True, exist_ok=True)
                written.append(_copy(src / folder / name, dest / folder / name))
    return written + _export_run_files(run, dest / rel)


def _export_run_files(run: Path, out: Path) -> list[Path]:
    """A finished run's RUN_FILES and its metrics cut to KEPT_METRICS, into out."""
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        if (run / name).is_file():
            written.append(_copy(run / name, out / name))
    try:  # bytes that are not UTF-8 (a torn write) are read as U+FFFD
        text = (run / runfiles.METRICS).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        text = ""
    lines = [ln for ln in text.splitlines() if ln.strip() and _kind(ln) in KEPT_METRICS]
    write_atomic(out / runfiles.METRICS, "".join(ln + "\n" for ln in lines))
    return written + [out / runfiles.METRICS]


def _export_study(src: Path, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    written = [_copy(src / n, dest / n) for n in STUDY_FILES if (src / n).is_file()]
    for rung in sorted(p.parent for p in src.glob("*/rung.json")):
        (dest / rung.name).mkdir(exist_ok=True)
        written.append(_copy(rung / "rung.json", dest / rung.name / "rung.json"))
        for part in ("sweep", "compare"):
            if (rung / part / "runs").is_dir():
                written += export_results(rung / part, dest / rung.name / part)
    return written


def _copy(src: Path, dst: Path) -> Path:
    """src's bytes to dst, atomically: on a full disk no half-written file is left for a
    later `nlq report` to take for a run's summary (the error names the file and ENOSPC)."""
    write_atomic(dst, src.read_bytes())
    return dst


def _kind(line: str) -> str | None:
    try:
        return json.loads(line).get("kind")
    except (json.JSONDecodeError, AttributeError):
        return None  # a torn last line of a killed run: not worth keeping
