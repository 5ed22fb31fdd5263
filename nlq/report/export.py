"""What of an experiment, sweep or study folder is worth committing: everything a reader needs to check
the report and `nlq report` needs to rebuild it, and none of the weights.

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
        run = summary.parent
        out = dest / run.relative_to(src)
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
        written.append(out / runfiles.METRICS)
    return written


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
