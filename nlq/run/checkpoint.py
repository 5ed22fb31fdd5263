"""Checkpoints that survive kill -9: safetensors + JSON, atomic, checksummed, no pickle.

Layout of RUN_DIR/ckpt/:
    step_000100/model.safetensors   full weights (tied alias dropped), any world size
    step_000100/optim.safetensors   AdamW moments and step counts keyed by parameter name
    step_000100/state.json          step, tokens, metrics offset, config, sha256 of the files,
                                    and what the run depends on (see depends())
    latest                          "step_000100", replaced atomically after the dir is complete

A checkpoint dir is written under a temporary name, every file fsync'ed, then renamed; the
`latest` pointer is updated last. A reader verifies the sha256 of every file and falls back
to the newest older checkpoint that verifies. The data position needs no state beyond the
step (nlq/data/schedule.py) and dropout is reseeded from (seed, step, rank) each step, so
step + weights + optimizer moments are everything a bitwise-exact resume needs, given the same
config and the same data: state.json records both (depends()), and a resume refuses a
config.toml edited since, or data that differ, naming what changed (check_depends()).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nlq import runfiles
from nlq.config import Config, flatten, from_dict
from nlq.errors import NlqError
from nlq.fsutil import fsync, write_atomic

FORMAT = 1
# what resuming reads from state.json (nlq/train/loop.py)
STATE_KEYS = ("step", "tokens", "elapsed", "metrics_bytes", "model_config", "param_groups")


@dataclass
class Checkpoint:
    path: Path
    state: dict
    model: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def optim_to_flat(osd: dict) -> dict[str, torch.Tensor]:
    """get_optimizer_state_dict(full) {"state": {fqn: {k: t}}} -> {"k/fqn": t}."""
    flat = {}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            t = v if torch.is_tensor(v) else torch.tensor(v)
            flat[f"{k}/{fqn}"] = t.detach().to("cpu").contiguous()
    return flat


def flat_to_optim(flat: dict[str, torch.Tensor], param_groups: list[dict]) -> dict:
    state: dict[str, dict] = {}
    for key, t in flat.items():
        k, _, fqn = key.partition("/")
        state.setdefault(fqn, {})[k] = t
    return {"state": state, "param_groups": param_groups}


def groups_json(groups: list[dict]) -> list[dict]:
    """AdamW's param_groups without the parameters, as JSON values (tuples as lists): what
    state.json keeps to rebuild the optimizer state dict (flat_to_optim)."""
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
             if isinstance(v, (int, float, str, bool, list, tuple)) or v is None}
            for g in groups]


def save(run_dir: Path, step: int, model_sd: dict, optim_flat: dict, state: dict,
         keep: int, on_stage: Callable[[str], None] | None = None) -> Path:
    """Write ckpt/step_{step} atomically, point `latest` at it, keep the newest `keep`.
    On any OSError (a full disk, a read-only dir) the partial dir is removed, the previous
    checkpoints and `latest` are untouched, and an NlqError names the path. on_stage(name)
    runs after each stage of the write (the crash tests kill the process there,
    nlq/train/faults.py)."""
    stage = on_stage or (lambda _name: None)
    root = run_dir / runfiles.CKPT
    name = f"step_{step:06d}"
    tmp = root / f".tmp-{name}"
    final = root / name
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_file(model_sd, str(tmp / "model.safetensors"))
        stage("ckpt_model")
        save_file(optim_flat, str(tmp / "optim.safetensors"))
        stage("ckpt_optim")
        files = {}
        for fname in ("model.safetensors", "optim.safetensors"):
            fsync(tmp / fname)
            files[fname] = sha256(tmp / fname)
        state = {**state, "format": FORMAT, "step": step, "sha256": files}
        with open(tmp / "state.json", "w") as f:
            json.dump(state, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if isinstance(state.get("model_config"), dict):
            # beside the weights, as save_pretrained writes it: Transformer.from_pretrained
            # (and anything that reads a model folder) loads a checkpoint dir as it is
            (tmp / "config.json").write_text(
                json.dumps(state["model_config"], indent=2, sort_keys=True))
        fsync(tmp)
        stage("ckpt_state")
        if final.exists():  # a checkpoint of this step from a run that was then interrupted
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync(root)
        stage("ckpt_rename")
        write_atomic(root / "latest", name + "\n")
        stage("ckpt_latest")
    except (OSError, SafetensorError) as e:  # safetensors reports ENOSPC as SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        raise NlqError(
            f"checkpoint write to {final} failed ({getattr(e, 'strerror', None) or e}); the "
            f"previous checkpoint "
            f"is kept: free space or fix permissions, then `nlq train --resume {run_dir}`"
        ) from None
    for old in sorted(root.glob("step_*"))[:-keep]:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def verify(d: Path) -> dict:
    """state.json of checkpoint dir d if every file matches its sha256, else raise."""
    try:
        state = json.loads((d / "state.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"unreadable state.json ({e})") from None
    if not isinstance(state, dict):  # valid JSON, but no checkpoint state
        state = {}
    for fname, digest in state.get("sha256", {}).items():
        p = d / fname
        if not p.is_file():
            raise ValueError(f"missing {fname}")
        if sha256(p) != digest:
            raise ValueError(f"{fname} fails its sha256 (truncated or corrupted)")
    if set(state.get("sha256", {})) != {"model.safetensors", "optim.safetensors"}:
        raise ValueError("state.json lists no checksums")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:  # hand-edited or from another version: not a checkpoint we can resume
        raise ValueError(f"state.json lacks {', '.join(missing)}")
    return state


def any_saved(run_dir: Path) -> bool:
    """Whether a checkpoint dir was ever completed in run_dir (valid or not)."""
    root = run_dir / runfiles.CKPT
    return root.is_dir() and any(root.glob("step_*"))


def load_latest(run_dir: Path) -> Checkpoint:
    """The newest checkpoint that verifies: `latest` first, then older step dirs."""
    root = run_dir / runfiles.CKPT
    dirs = sorted(root.glob("step_*"), reverse=True) if root.is_dir() else []
    if not dirs:
        raise NlqError(f"no checkpoint in {run_dir} (nothing to resume: start a new run with "
                       f"`nlq train CONFIG --out {run_dir}`)")
    latest = root / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        if name not in {d.name for d in dirs}:
            print(f"nlq: warning: {latest} names {name!r}, which is not there; using the "
                  f"newest checkpoint that verifies", file=sys.stderr)
        dirs.sort(key=lambda d: (d.name != name, -int(d.name.split("_")[1])))
    else:
        print(f"nlq: warning: {latest} is missing; using the newest checkpoint that verifies",
              file=sys.stderr)
    problems = []
    for d in dirs:
        try:
            state = verify(d)
            model = load_file(str(d / "model.safetensors"))
            optim = load_file(str(d / "optim.safetensors"))
        except (ValueError, SafetensorError, OSError) as e:
            problems.append(f"{d.name}: {e}")
            print(f"nlq: warning: skipping checkpoint {d}: {e}", file=sys.stderr)
            continue
        return Checkpoint(d, state, model, optim)
    raise NlqError(f"no valid checkpoint in {root}: " + "; ".join(problems))


def step_dirs(run_dir: Path) -> dict[int, Path]:
    """Every completed checkpoint dir of run_dir by its step (verified or not), oldest first."""
    root = run_dir / runfiles.CKPT
    found = {}
    for d in root.glob("step_*") if root.is_dir() else []:
        digits = d.name.removeprefix("step_")
        if digits.isdigit():
            found[int(digits)] = d
    return dict(sorted(found.items()))


def chosen(run_dir: Path, step: int | None = None) -> tuple[Path, dict]:
    """(checkpoint dir, its verified state.json) of `step`, or of the newest step when None.
    What a model is read for (eval, sample, convert): unlike load_latest, which resume uses,
    it never puts an older checkpoint in place of a corrupt one, since a score or a folder
    would then silently belong to another step than the run's; the error lists the steps
    that verify, to choose one with --step."""
    dirs = step_dirs(run_dir)
    if not dirs:
        raise NlqError(f"{run_dir} has no checkpoint yet: a run writes one every "
                       f"train.ckpt_interval steps and at its end")
    if step is not None and step not in dirs:
        raise NlqError(f"{run_dir} has no checkpoint of step {step}: --step takes one of "
                       f"{', '.join(map(str, dirs))}")
    d = dirs[max(dirs) if step is None else step]
    try:
        return d, verify(d)
    except ValueError as e:
        why = str(e)
    good = []
    for s, other in dirs.items():
        try:
            verify(other)
            good.append(str(s))
        except ValueError:
            continue
    which = "the newest checkpoint" if step is None else "checkpoint"
    hint = (f"choose another with --step ({', '.join(good)} verify)" if good else
            "no checkpoint of this run verifies")
    raise NlqError(f"{which} {d} fails to verify: {why}; {hint}")


# The files of a data dir (`nlq prepare`) that a run reads.
DATA_FILES = ("meta.json", "train.bin", "val.bin", "test.bin")


def depends(cfg: Config) -> dict:
    """What a run's weights depend on besides its checkpoint: the resolved config, and the
    data it reads: the absolute folder (a relative data.dir depends on the working directory)
    and each file's size and sha256 (hashed once per process start, at ~1.5 GB/s)."""
    d = Path(cfg.data.dir).resolve()
    files = {name: {"bytes": (d / name).stat().st_size, "sha256": sha256(d / name)}
             for name in DATA_FILES if (d / name).is_file()}
    return {"config": cfg.to_dict(), "data_dir": str(d), "data": files}


def check_config(recorded: dict, now: dict, ck_path: Path, run_dir: Path) -> None:
    """Refuse RUN/config.toml (now, a config dict) when it differs from the config checkpoint
    ck_path recorded (NlqError naming each changed key, old -> new)."""
    try:  # read by this version, as config.toml is: a key added since gets its default
        old = from_dict(recorded).to_dict()
    except NlqError:
        old = recorded
    before, after = flatten(old), flatten(now)
    # data.dir is where the data is, not what it is: the files' sizes and sha256 are compared
    # apart (check_depends), so a data dir moved (and config.toml edited to say where) resumes
    changed = [k for k in sorted(set(before) | set(after)) if k != "data.dir"
               and before.get(k, "(absent)") != after.get(k, "(absent)")]
    if changed:
        what = "; ".join(f"{k} = {before.get(k, '(absent)')!r} -> {after.get(k, '(absent)')!r}"
                         for k in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise NlqError(f"{run_dir / runfiles.CONFIG} changed since checkpoint {ck_path}: {what}"
                       f"{more}; resuming would silently continue another run: put the old "
                       f"values back, or train the new config into another --out")


def check_depends(ck: Checkpoint, now: dict, run_dir: Path) -> list[str]:
    """Refuse to resume from ck when RUN/config.toml or the data differ from what ck records
    (NlqError naming each changed key, old -> new, or the data file that differs); returns
    warnings: a checkpoint that records nothing (older nlq), a data dir that moved but
    holds identical files (the run continues: its files are what the weights depend on)."""
    rec = ck.state.get("depends")
    if not isinstance(rec, dict) or not isinstance(rec.get("config"), dict):
        return [(f"checkpoint {ck.path} records neither the config nor the data it was "
                 f"trained on (written by an older nlq): resuming without checking that they "
                 f"are unchanged")]
    check_config(rec["config"], now["config"], ck.path, run_dir)
    rec_files = rec.get("data") if isinstance(rec.get("data"), dict) else {}
    rec_dir, now_dir = rec.get("data_dir"), now["data_dir"]
    diff = []
    for name in sorted(set(rec_files) | set(now["data"])):
        a, b = rec_files.get(name), now["data"].get(name)
        if a == b:
            continue
        if b is None or a is None:
            diff.append(f"{name} {'missing' if b is None else 'not there before'}")
        elif a.get("bytes") != b.get("bytes"):
            diff.append(f"{name} ({a.get('bytes')} -> {b.get('bytes')} bytes)")
        else:
            diff.append(f"{name} (same size, other sha256)")
    if diff:
        where = (f"{now_dir}" if rec_dir == now_dir else
                 f"{now_dir} (data.dir resolved from {os.getcwd()}; the checkpoint's data was "
                 f"in {rec_dir})")
        raise NlqError(f"the data in {where} is not what checkpoint {ck.path} was trained on: "
                       f"{', '.join(diff)}; resume with the data it was trained on")
    if rec_dir != now_dir:
        return [(f"data dir moved: {rec_dir} -> {now_dir}; its files are identical (size "
                 f"and sha256), so the run continues")]
    return []
