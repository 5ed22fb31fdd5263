"""`nlq reproduce`: the paper's comparison as one command.

An experiment (nlq/experiments/experiment.py: its arms by name, a [base] of overrides, its
claims) is resolved against a preset and written to OUT/experiment.toml; every arm runs for
every seed as an ordinary `nlq train` run dir under OUT/runs/<arm>/seed<k>/. Seed k sets the
init seed train.seed + k and the data seed data.seed + k for every arm: arms with the same k
see identical batches and start with the same values in every tensor they share
(nlq/model/transformer.py, reset_parameters), so arms are paired by seed, and seeds differ in
both init and data order. Running the command again skips
finished runs and resumes interrupted ones. The report (nlq/eval/report.py) is written to
OUT at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nlq import runfiles
from nlq.config import Config, flatten, load_config
from nlq.errors import NlqError
from nlq.eval.claims import EXPERIMENT_FILE
from nlq.eval.report import build_report, print_summary
from nlq.experiments.experiment import Experiment, experiment_arms, experiment_toml, load_experiment
from nlq.fsutil import write_atomic
from nlq.model.params import count_params, flops_per_token
from nlq.runfiles import read_summary

# How `nlq reproduce` prepares each preset's data dir when it is missing.
PRESET_DATA = {
    "tiny": ("embedded", "bpe:8192"),
    "small": ("embedded:all", "bpe:512"),
    "gpt3-small": ("hf:openwebtext", "gpt2"),
}


@dataclass(frozen=True)
class RunSpec:
    arm: str
    seed_index: int
    cfg: Config
    run_dir: Path
    tag: str = ""  # e.g. a sweep's lr: part of the config file's name
    replicate: bool = False
    """A numerical replicate: the run of (arm, seed_index) again at another thread count,
    i.e. another float summation order; it measures rounding noise and is never a seed."""

    @property
    def config_name(self) -> str:
        rep = f"-threads{self.cfg.train.threads}" if self.replicate else ""
        return f"{self.tag}{self.arm}-seed{self.seed_index}{rep}.toml"

    @property
    def threads(self) -> int:
        return self.cfg.train.threads or 1


def plan(exp: Experiment, preset: str, seeds: int, arm_names: list[str] | None,
         out: Path, sets: dict | None = None, threads: int = 1,
         replicates: int = 0, replicate_threads: int | None = None) -> list[RunSpec]:
    """Every arm x seed at `threads` intra-op threads (a fixed count, not the machine's
    cores: the same command then sums floats in the same order on any machine of the same
    ISA), plus, for the first `replicates` seeds, each arm again at replicate_threads: the
    numerical replicates the report's rounding-noise section compares."""
    if seeds < 2:
        # the report's intervals, its positive control and every verdict need two seeds per
        # arm at least; one-seed runs are `nlq train`, and `nlq report` still reads them
        raise NlqError(f"--seeds must be >= 2 (the report's intervals and positive control "
                       f"need 2 seeds per arm at least; 8 in the README's design), got {seeds}")
    names = list(exp.arms)
    if arm_names:
        unknown = [a for a in arm_names if a not in exp.arms]
        if unknown:
            raise NlqError(f"unknown arm {unknown[0]!r} in --arms (experiment {exp.name!r} "
                           f"has: {', '.join(exp.arms)})")
        names = [a for a in exp.arms if a in arm_names]
        if exp.baseline not in names:
            names.insert(0, exp.baseline)  # every comparison needs the baseline
    if not 0 <= replicates <= seeds:
        raise NlqError(f"--replicates must be between 0 and --seeds ({seeds}), got {replicates}")
    if replicates and replicate_threads in (None, threads):
        raise NlqError(f"--replicate-threads must differ from --threads ({threads}): a "
                       f"replicate at the same thread count is the same run, bit for bit")
    arms = experiment_arms(exp, preset, sets, names)
    # seed k: init seed train.seed + k and data order data.seed + k, the same in every arm
    specs = [RunSpec(a, k, cfg.replace(**{"train.seed": cfg.train.seed + k,
                                          "data.seed": cfg.data.seed + k,
                                          "train.threads": threads}),
                     out / "runs" / a / f"seed{k}")
             for k in range(seeds) for a, cfg in arms.items()]
    reps = [dataclasses.replace(s, cfg=s.cfg.replace(**{"train.threads": replicate_threads}),
                                run_dir=s.run_dir.with_name(f"{s.run_dir.name}-threads"
                                                            f"{replicate_threads}"),
                                replicate=True)
            for s in specs if s.seed_index < replicates]
    return specs + reps


def ensure_data(preset: str, cfg: Config) -> None:
    d = Path(cfg.data.dir)
    meta = d / "meta.json"
    try:
        old = meta.is_file() and "test_tokens" not in json.loads(meta.read_text())
    except (OSError, ValueError, TypeError):  # `nlq train` names what is wrong with it
        return
    if meta.is_file() and not (old and cfg.train.test_eval):
        return
    if preset not in PRESET_DATA:
        what = "has no test split" if old else "is missing"
        raise NlqError(f"data dir {d} {what}: prepare it with `nlq prepare --out {d} --force`")
    source, tok = PRESET_DATA[preset]
    why = "it has no test split" if old else "missing"
    print(f"reproduce: preparing {d} ({source}, {tok}; {why})", file=sys.stderr)
    cmd = [sys.executable, "-m", "nlq", "prepare", "--source", source, "--tokenizer", tok,
           "--out", str(d), *(["--force"] if old else [])]
    if subprocess.run(cmd, check=False).returncode != 0:
        raise NlqError(f"`{' '.join(cmd[2:])}` failed (see above)")


def print_cost(specs: list[RunSpec], out: Path, gpus: int = 8, mfu: float = 0.40,
               peak_tflops: float = 989.0) -> None:
    """What a gpt3-small reproduction costs, and the commands that run it."""
    print(f"No CUDA GPU here: not starting {len(specs)} GPT-3-small runs. The plan:")
    total_h = 0.0
    for s in specs:
        t = s.cfg.train
        tokens = t.max_steps * t.micro_batch * t.grad_accum * s.cfg.model.block_size
        flops = flops_per_token(s.cfg.model) * tokens
        hours = flops / (mfu * peak_tflops * 1e12) / 3600
        total_h += hours
        print(f"- {s.arm} seed{s.seed_index}: {count_params(s.cfg.model)[0]:,} params, "
              f"{tokens / 1e9:.2f}B tokens, {flops:.3g} FLOPs = {hours:.1f} GPU-hours at "
              f"{mfu:.0%} MFU of {peak_tflops:.0f} TFLOP/s (H100 bf16 dense)")
    print(f"total: {total_h:.0f} GPU-hours. Prepare the data (needs a network):\n"
          f"  nlq prepare --source hf:openwebtext --tokenizer gpt2 --out "
          f"{specs[0].cfg.data.dir}\nthen, per run, on a node with {gpus} GPUs:")
    for s in specs:
        print(f"  torchrun --standalone --nproc_per_node {gpus} -m nlq train "
              f"{out / 'configs' / f'{s.arm}-seed{s.seed_index}.toml'} --out {s.run_dir}")
    print(f"then: nlq report {out}   (or run `nlq reproduce --preset gpt3-small --force` "
          f"to train them one after the other here)")


def run_states(specs: list[RunSpec]) -> dict[Path, str]:
    """Each planned run's state (_run_state), every one checked before anything is written:
    a command that is refused leaves OUT as it was."""
    return {s.run_dir: _run_state(s) for s in specs}


def _run_state(spec: RunSpec) -> str:
    """finished, resume or new. A run dir is reused (finished, or resumed) only when the
    config it holds, resolved as this nlq reads it, equals the one planned for it, key for
    key: one of another config (e.g. another lr or max_steps) is an error, finished or not,
    naming the keys that differ: its numbers would answer another question."""
    d = spec.run_dir
    summary, why = read_summary(d)
    if (d / runfiles.CONFIG).is_file():
        diff = config_diff(load_config(d / runfiles.CONFIG), spec.cfg)
        if diff:
            what = "; ".join(f"{k} = {a!r} there, {b!r} now" for k, a, b in diff[:4])
            more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
            raise NlqError(f"{d} holds a run of another config than this command plans (arm "
                           f"{spec.arm!r}, seed {spec.seed_index}: {what}{more}): use another "
                           f"--out, or remove {d} to train it again")
    elif summary is not None or why is not None:
        raise NlqError(f"{d} holds summary.json but no config.toml: what it ran cannot be "
                       f"checked against this plan; use another --out, or remove {d}")
    if summary is not None:
        return "finished"
    saved = any((d / runfiles.CKPT).glob("step_*"))
    if why is not None and not saved:
        raise NlqError(f"{d / 'summary.json'} {why}, and {d} holds no checkpoint to recompute "
                       f"it from: restore the file, or remove {d} to train the run again")
    if why is not None:
        print(f"reproduce: warning: {d / 'summary.json'} {why}: the run is resumed from its "
              f"last checkpoint, which writes it again", file=sys.stderr)
    return "resume" if saved else "new"


def config_diff(a: Config, b: Config) -> list[tuple[str, object, object]]:
    """(key, value in a, value in b) for every key where the resolved configs differ, as plain
    values: nothing is left out (train.device is compared as written, "auto" included)."""
    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    return [(k, fa.get(k, "(absent)"), fb.get(k, "(absent)")) for k in sorted(set(fa) | set(fb))
            if fa.get(k, "(absent)") != fb.get(k, "(absent)")]


def _last_step(run_dir: Path) -> int:
    """The last logged step of a running run (for the progress bar only)."""
    try:
        with open(run_dir / runfiles.METRICS, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode("utf-8", "replace").splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line).get("step", 0))
            except (AttributeError, ValueError, TypeError):  # not JSON, not a row, no step
                continue
    except OSError:
        pass
    return 0


def run_all(specs: list[RunSpec], exp: Experiment, jobs: int, out: Path,
            states: dict[Path, str] | None = None) -> list[str]:
    """Train every planned run (jobs at a time, within jobs x threads cores); returns the
    arms/seeds that failed. Each run is a subprocess `nlq train`, so a crash or a divergence
    of one run never takes the others down. states: run_states(specs), if checked already."""
    from tqdm import tqdm

    states = states or run_states(specs)
    todo = []
    for s in specs:
        state = states[s.run_dir]
        if state == "finished":
            continue
        cfg_path = out / "configs" / s.config_name
        if state == "new":
            shutil.rmtree(s.run_dir, ignore_errors=True)  # a start that never checkpointed
            s.run_dir.mkdir(parents=True)
            rep = {"replicate": True} if s.replicate else {}
            write_atomic(s.run_dir / runfiles.ARM, json.dumps(
                {"experiment": exp.name, "arm": s.arm, "seed_index": s.seed_index, **rep}))
            cmd = ["train", str(cfg_path), "--out", str(s.run_dir)]
        else:
            cmd = ["train", "--resume", str(s.run_dir)]
        todo.append((s, cmd))
    if not todo:
        print(f"reproduce: all {len(specs)} runs finished already", file=sys.stderr)
        return []
    total = sum(s.cfg.train.max_steps for s, _ in todo)
    done_steps = {s.run_dir: _last_step(s.run_dir) for s, _ in todo}
    # jobs runs at the command's thread count: a budget of threads, so that a replicate at
    # more threads waits for room (oversubscribed cores stall a multi-threaded run's
    # barriers many times over); a run that needs more than the budget runs alone
    budget = jobs * max([s.threads for s in specs if not s.replicate] or [1])
    failed, running = [], []
    queue = list(todo)
    bar = tqdm(total=total, initial=sum(done_steps.values()), unit="step", dynamic_ncols=True,
               desc=f"{len(todo)} runs", file=sys.stderr)
    while queue or running:
        while queue and (not running or sum(r[0].threads for r in running)
                         + queue[0][0].threads <= budget):
            s, cmd = queue.pop(0)
            # open while the run lives: closed when it ends, below; never through a symlink
            log = os.fdopen(os.open(s.run_dir / runfiles.TRAIN_LOG, os.O_WRONLY | os.O_APPEND |
                                    os.O_CREAT | os.O_NOFOLLOW, 0o666), "a")
            # the run sets its own pool (train.threads); OpenMP outside torch's pool agrees
            env = {**os.environ, "OMP_NUM_THREADS": str(s.threads)}
            p = subprocess.Popen([sys.executable, "-m", "nlq", *cmd, "--no-progress"],
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((s, p, log))
        time.sleep(0.5)
        for item in list(running):
            s, p, log = item
            now = _last_step(s.run_dir)
            bar.update(now - done_steps[s.run_dir])
            done_steps[s.run_dir] = now
            if p.poll() is None:
                continue
            running.remove(item)
            log.close()
            summ = read_summary(s.run_dir)[0] if p.returncode == 0 else None
            if summ is None:  # failed, or stopped by a signal before it finished
                failed.append(f"{s.arm}/{s.run_dir.name}")
                tail = (s.run_dir / runfiles.TRAIN_LOG).read_text(errors="replace").strip()
                bar.write(f"reproduce: {s.arm} {s.run_dir.name} failed (exit "
                          f"{p.returncode}): {tail.splitlines()[-1] if tail else ''}")
            else:
                bar.write(f"reproduce: {s.arm} {s.run_dir.name}: val loss "
                          f"{summ['val_loss']:.4f} ({summ['tok_per_s']:,.0f} tok/s)")
    bar.close()
    return failed


def read_sweep_lrs(path: Path, preset: str, sets: dict | None, arms: list[str]) -> dict:
    """Each arm's chosen lr from a sweep.json, checked against this reproduce's setting."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:  # not JSON, not UTF-8
        raise NlqError(f"--lrs-from {path}: cannot read a sweep.json: {e}") from None
    if not isinstance(result, dict) or not isinstance(result.get("chosen"), dict):
        raise NlqError(f"--lrs-from {path}: not a sweep.json written by `nlq sweep`")
    if result.get("preset") != preset:
        raise NlqError(f"--lrs-from {path}: the sweep ran on preset {result.get('preset')!r}, "
                       f"this command on {preset!r}")
    mine = {k: (sets or {})[k] for k in sorted(sets or {})}
    if result.get("sets", {}) != mine:
        raise NlqError(f"--lrs-from {path}: the sweep ran with --set {result.get('sets')}, "
                       f"this command with {mine}: its lrs were chosen for another setting")
    missing = [a for a in arms if a not in result["chosen"]]
    if missing:
        raise NlqError(f"--lrs-from {path}: arm {missing[0]!r} was not swept (the sweep has "
                       f"{', '.join(result['chosen'])})")
    for a in arms:
        lr = result["chosen"][a].get("lr") if isinstance(result["chosen"][a], dict) else None
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
            raise NlqError(f"--lrs-from {path}: chosen.{a}.lr is {lr!r}, not a learning rate "
                           f"(a sweep.json written by `nlq sweep` has one per arm)")
    return {"source": str(path), "commit": result.get("commit"), "dirty": result.get("dirty"),
            "lrs": {a: result["chosen"][a]["lr"] for a in arms}}


def with_lrs(specs: list[RunSpec], lrs: dict[str, float]) -> list[RunSpec]:
    """specs with each arm at its lr (a sweep's choice); min_lr keeps its ratio to lr."""
    return [dataclasses.replace(s, cfg=s.cfg.replace(**{
        "train.lr": lrs[s.arm], "train.min_lr": lrs[s.arm] * s.cfg.train.min_lr / s.cfg.train.lr}))
        for s in specs]


def reproduce(experiment: str, preset: str, seeds: int, arm_names: list[str] | None,
              out: Path, jobs: int, force: bool, sets: dict | None = None,
              lrs_from: Path | None = None, threads: int = 1, replicates: int = 0,
              replicate_threads: int | None = None) -> int:
    import torch

    exp = load_experiment(experiment)
    specs = plan(exp, preset, seeds, arm_names, out, sets, threads, replicates,
                 replicate_threads)
    lrs = None
    if lrs_from is not None:  # each arm at the lr its sweep chose on val
        lrs = read_sweep_lrs(lrs_from, preset, sets, sorted({s.arm for s in specs}))
        specs = with_lrs(specs, lrs["lrs"])
    states = run_states(specs)  # a run dir of another config is refused before any write
    cost_only = preset == "gpt3-small" and not torch.cuda.is_available() and not force
    if not cost_only:  # a config that cannot fit is refused before any write, too
        from nlq.train.dist import resolve_device
        from nlq.train.memory import check_fits

        for cfg in {s.arm: s.cfg for s in specs}.values():  # `jobs` runs share this machine
            check_fits(cfg, resolve_device(cfg.train.device), procs=min(jobs, len(specs)))
    out.mkdir(parents=True, exist_ok=True)
    if lrs is not None:
        write_atomic(out / "lrs.json", json.dumps(lrs, indent=2))
    # the experiment as resolved, for `nlq report OUT` to find its claims
    write_atomic(out / EXPERIMENT_FILE, experiment_toml(exp))
    (out / "configs").mkdir(exist_ok=True)
    for s in specs:
        write_atomic(out / "configs" / s.config_name, s.cfg.to_toml())
    if cost_only:  # the configs written above are what the printed commands train
        print_cost(specs, out)
        return 0
    ensure_data(preset, specs[0].cfg)
    t0 = time.time()
    failed = run_all(specs, exp, jobs, out, states)
    if len(failed) == len(specs):
        print(f"reproduce: every run failed ({', '.join(failed)}); see their train.log, then "
              f"run the command again to resume them", file=sys.stderr)
        return 1
    rep = build_report([s.run_dir for s in specs], out, baseline=exp.baseline,
                       title=f"nlq reproduce: {exp.name} ({preset} preset, {seeds} seed(s))",
                       claims=exp.claims)
    print(f"reproduce: {len(specs)} runs in {time.time() - t0:.0f} s; wrote {out / 'report.md'}, "
          f"{out / 'report.json'}, {out / 'fig1.png'}")
    print_summary(rep)
    if failed:
        print(f"reproduce: {len(failed)} run(s) failed: {', '.join(failed)} (see their "
              f"train.log; run the command again to retry)", file=sys.stderr)
        return 1
    return 0
