"""The layout of a run dir, in one place: its file names and the one reader of its summary.

A run dir (written by rank 0 of `nlq train`, nlq/train/rundir.py and nlq/run/checkpoint.py):

    config.toml      the run's config, written once the run is set up (its existence makes a
                     folder a run dir)
    metrics.jsonl    one JSON object per line: meta, train, eval and spike rows
    summary.json     a finished run's summary (nlq/train/loop.py, finish())
    test_docs.json   the test split's nats and tokens per document
    ckpt/step_NNNNNN/  checkpoints;  tb/  TensorBoard events
    arm.json, train.log   what `nlq reproduce` writes beside a run it starts
    .lock            held while a process writes the run

Everyone else (training, reports, export, eval, the experiment drivers) names these files
through the constants below and reads a summary through read_summary, so a change of the
layout is a change here.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TEST_DOCS = "test_docs.json"
ARM = "arm.json"
TRAIN_LOG = "train.log"
LOCK = ".lock"
CKPT = "ckpt"
TB = "tb"

# summary.json keys that are numbers (what finish() writes): a reader checks them
SUMMARY_INTS = ("step", "tokens", "n_spikes", "params_total", "params_non_embedding",
                "test_docs", "test_tokens", "warmup_steps", "world_size")
SUMMARY_FLOATS = ("test_loss", "test_ppl", "val_ppl", "elapsed_s", "tok_per_s")


def is_run_dir(path: Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def read_summary(run_dir: Path) -> tuple[dict | None, str | None]:
    """RUN/summary.json of a finished run: (summary, None); (None, None) when there is none;
    (None, why) when it is there but is not a finished run's summary (not JSON, not an
    object, no status "finished" or no integer step)."""
    path = Path(run_dir) / SUMMARY
    try:
        s = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, (f"is not valid JSON ({e})" if isinstance(e, ValueError)
                      else f"cannot be read ({e.strerror or e})")
    if not isinstance(s, dict) or s.get("status") != "finished":
        return None, "is not a finished run's summary (no status \"finished\")"
    if not is_int(s.get("step")):
        return None, f"has no integer step (step = {s.get('step')!r})"
    return s, None


def checked_summary(summary: dict, notes: list[str]) -> dict:
    """summary without the keys whose values are not what the trainer writes (a hand-edited
    or foreign file), each named in notes: reports read them as numbers."""
    bad = [k for k in SUMMARY_INTS if k in summary and not is_int(summary[k])]
    bad += [k for k in SUMMARY_FLOATS if k in summary and (
        not isinstance(summary[k], (int, float)) or isinstance(summary[k], bool))]
    if "spikes" in summary and not (isinstance(summary["spikes"], list) and all(
            isinstance(x, dict) for x in summary["spikes"])):
        bad.append("spikes")
    if bad:
        notes.append(f"summary.json: {', '.join(f'{k} = {summary[k]!r}' for k in bad)} "
                     f"ignored (not what nlq writes)")
    if "test_loss" in summary and "test_tokens" not in summary and "test_loss" not in bad:
        bad.append("test_loss")  # a test loss is reported with its token count
        notes.append("summary.json: test_loss without test_tokens ignored")
    return {k: v for k, v in summary.items() if k not in bad}


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
