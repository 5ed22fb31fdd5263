"""`nlq reproduce`: the paper's comparison as one command.

An experiment (nlq/experiments/experiment.py: its arms by name, a [base] of overrides, its
claims) is resolved against a preset and written to OUT/experiment.toml; every arm runs for
every seed as an ordinary `nlq train` run dir under OUT/runs/<arm>/seed<k>/. Seed k sets the
init seed train.seed + k and the data seed data.seed + k for every arm: arms with the same k
see identical batches and start with the same values in every tensor they share
(nlq/model/transformer.py, reset_parameters), so arms are paired by seed, and seeds differ in
both init and data order. Running the command again skips
finished runs and resumes interrupted ones. The report (nlq/report/report.py) is written to
OUT at the end.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from nlq import runfiles
from nlq.config import Config
from nlq.errors import NlqError
from nlq.experiments.experiment import Experiment, experiment_arms, experiment_toml, load_experiment
from nlq.experiments.plan import RunSpec, check_out, resolve_jobs, run_states
from nlq.experiments.runner import run_all
from nlq.fsutil import write_atomic
from nlq.model.params import count_params, flops_per_token
from nlq.report.claims import EXPERIMENT_FILE
from nlq.report.report import build_report, print_summary

# How `nlq reproduce` prepares each preset's data dir when it is missing.
PRESET_DATA = {
    "tiny": ("embedded", "bpe:8192"),
    "small": ("embedded:all", "bpe:512"),
    "gpt3-small": ("hf:openwebtext", "gpt2"),
}


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
    edge = result.get("edge") if isinstance(result.get("edge"), dict) else {}
    return {"source": str(path), "commit": result.get("commit"), "dirty": result.get("dirty"),
            "lrs": {a: result["chosen"][a]["lr"] for a in arms},
            # arms whose best lr was the grid's edge: the best may lie beyond what was tried
            **({"edge": [a for a in arms if edge.get(a) is True]}
               if any(edge.get(a) is True for a in arms) else {})}


def with_lrs(specs: list[RunSpec], lrs: dict[str, float]) -> list[RunSpec]:
    """specs with each arm at its lr (a sweep's choice); min_lr keeps its ratio to lr."""
    return [dataclasses.replace(s, cfg=s.cfg.replace(**{
        "train.lr": lrs[s.arm], "train.min_lr": lrs[s.arm] * s.cfg.train.min_lr / s.cfg.train.lr}))
        for s in specs]


def check_claims(out: Path, exp: Experiment) -> None:
    """Refuse to change the pre-registered claims (ordering, comparisons, positive control)
    of a folder that holds finished runs: a family chosen after its runs are seen is not
    pre-registered (use another --out)."""
    path = out / EXPERIMENT_FILE
    if not path.is_file() or not any((out / "runs").rglob(runfiles.SUMMARY)):
        return
    try:
        before = load_experiment(path).claims
    except NlqError:
        return  # not a file nlq wrote: the runs' configs are checked run by run
    keys = ("ordering", "comparisons", "positive_control")
    diff = [k for k in keys if getattr(before, k) != getattr(exp.claims, k)]
    if diff:
        k = diff[0]
        raise NlqError(f"{out} holds finished runs judged under hypothesis.{k} = "
                       f"{getattr(before, k)!r} ({path}); experiment {exp.name!r} now declares "
                       f"{getattr(exp.claims, k)!r}: claims are fixed before the runs they "
                       f"judge (use another --out, or restore the experiment)")


def reproduce(experiment: str, preset: str, seeds: int, arm_names: list[str] | None,
              out: Path, jobs: int | None, force: bool, sets: dict | None = None,
              lrs_from: Path | None = None, threads: int = 1, replicates: int = 0,
              replicate_threads: int | None = None, launcher: str = "local",
              stack: int = 1, after_run=None) -> int:
    """after_run(run_dir): called as each run finishes (runner.run_all)."""
    import torch

    check_out(out, "reproduce")  # a folder of the user's is refused before any work
    exp = load_experiment(experiment)
    specs = plan(exp, preset, seeds, arm_names, out, sets, threads, replicates,
                 replicate_threads)
    lrs = None
    if lrs_from is not None:  # each arm at the lr its sweep chose on val
        lrs = read_sweep_lrs(lrs_from, preset, sets, sorted({s.arm for s in specs}))
        specs = with_lrs(specs, lrs["lrs"])
    states = run_states(specs, stack=stack)  # another config's run dir: refused, no write
    cost_only = preset == "gpt3-small" and not torch.cuda.is_available() and not force
    if not cost_only:  # a config that cannot fit is refused before any write, too
        from nlq.run.memory import check_fits
        from nlq.train.dist import resolve_device

        jobs = resolve_jobs(jobs, specs, launcher, stack=stack)  # auto on a GPU: memory

        for cfg in {s.arm: s.cfg for s in specs}.values():  # `jobs` runs share this machine
            device = resolve_device(cfg.train.device)
            if device.type == "cuda":  # `jobs` runs share the GPU: each its share of it
                check_fits(cfg, device, procs=stack, gpu_share=min(jobs, len(specs)))
            else:  # a stack of K holds K runs' memory
                check_fits(cfg, device, procs=min(jobs * stack, len(specs)))
    out.mkdir(parents=True, exist_ok=True)
    if lrs is not None:
        write_atomic(out / "lrs.json", json.dumps(lrs, indent=2))
    # the experiment as resolved, for `nlq report OUT` to find its claims; claims are fixed
    # before the runs they judge: not re-declared over finished ones
    check_claims(out, exp)
    write_atomic(out / EXPERIMENT_FILE, experiment_toml(exp))
    (out / "configs").mkdir(exist_ok=True)
    for s in specs:
        write_atomic(out / "configs" / s.config_name, s.cfg.to_toml())
    if cost_only:  # the configs written above are what the printed commands train
        print_cost(specs, out)
        return 0
    ensure_data(preset, specs[0].cfg)
    t0 = time.time()
    failed = run_all(specs, exp, jobs, out, states, launcher, stack=stack, after_run=after_run)
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
