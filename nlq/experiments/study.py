"""`nlq study`: the fair comparison at every rung of a ladder of model sizes.

A ladder (nlq/experiments/ladder.toml, or any TOML of that form) names an experiment, its arms
and rungs; a rung is a preset plus config overrides, an lr grid and seed counts. For each rung
the study runs `nlq sweep` (every arm at every lr, on seeds the comparison never uses, the lr
chosen on val by a fit; when an arm's lowest grid point is an edge of the grid, the grid grows
by one of its steps on that side, to at most MAX_WIDEN times beyond the declared grid)
and then `nlq reproduce --lrs-from` (the seeds, scored on the test split, positive control
first), under OUT/<rung>/sweep and OUT/<rung>/compare. Both skip finished runs and resume
killed ones, so a study can be stopped and continued across days. Each rung's definition is
written to OUT/<rung>/rung.json when it starts; a different definition on resume is refused.
Every key of a ladder is checked when it is read (nlq/experiments/ladder.py), naming the key.
The study report (nlq/experiments/study_report.py) is rebuilt from the rungs' reports at the
end of every invocation.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from nlq import runfiles
from nlq.errors import NlqError
from nlq.experiments.experiment import experiment_arms, experiment_path, load_experiment
from nlq.experiments.ladder import RUNG_FILE, Ladder, Rung, load_ladder, rung_record
from nlq.experiments.plan import check_out
from nlq.experiments.reproduce import reproduce
from nlq.experiments.sweep import RESULT_FILE, grid_step, sweep
from nlq.fsutil import write_atomic
from nlq.model.params import flops_per_token

MAX_WIDEN = 4.0  # how far (a factor) a sweep's grid may grow per side when its best is an edge
H100_BF16_TFLOPS, GPU_MFU = 989.0, 0.40  # the GPU estimate's assumptions, printed with it


def check_rung(out: Path, record: dict, write: bool = True) -> None:
    """Refuse a rung whose record differs from the one it was started with (its seeds may
    change until an evaluation run has finished); write: record it (False: --dry-run)."""
    path = out / RUNG_FILE
    if path.is_file():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise NlqError(f"{path} cannot be read ({e}): it records how rung "
                           f"{record['name']!r} was started; restore it (the ladder's rung "
                           f"as it was), or use another --out") from None
        if not isinstance(before, dict):
            raise NlqError(f"{path} is not a rung record (a JSON object): restore it, or use "
                           f"another --out")
        diff = [k for k in sorted(set(before) | set(record)) if before.get(k) != record.get(k)]
        evaluated = (out / "compare").is_dir() and any((out / "compare").rglob(runfiles.SUMMARY))
        if diff == ["seeds"] and not evaluated:
            # the evaluation's size may be re-declared until its first run has finished: no
            # result has been seen, so a power analysis (another rung's variance) can set it
            print(f"study: rung {record['name']!r}: seeds {before.get('seeds')} -> "
                  f"{record['seeds']} (no evaluation run has finished: "
                  f"{'re-declared' if write else 'would be re-declared'})", file=sys.stderr)
            if write:
                write_atomic(path, json.dumps(record, indent=2))
            return
        if diff:
            k = diff[0]
            if k == "seeds" and len(diff) == 1:
                raise NlqError(f"{out}: rung {record['name']!r} was evaluated with seeds = "
                               f"{before.get(k)!r}, this study now has {record.get(k)!r}: "
                               f"seeds are fixed once an evaluation run has finished (more "
                               f"seeds after a result is seen is a new design: give the rung "
                               f"another name), or use another --out")
            raise NlqError(f"{out}: rung {record['name']!r} was started with {k} = "
                           f"{before.get(k)!r}, this study now has {record.get(k)!r}: a "
                           f"changed rung is a new rung (give it another name), or use "
                           f"another --out")
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=2))


# ---------------------------------------------------------------------------------------
# cost


def rung_cost(ladder: Ladder, rung: Rung, out: Path) -> dict:
    """Runs, tokens and FLOPs of a rung, and how many of its runs have finished. The sweep's
    grid is the one its plan holds once the sweep has started (a grid grown at an edge has
    more lrs than the ladder names); each phase counts its own finished runs."""
    exp = load_experiment(ladder.experiment)
    cfgs = experiment_arms(exp, rung.preset, rung.sets)
    arms = [a for a in cfgs if not ladder.arms or a in ladder.arms]
    plan = out / rung.name / "sweep" / "sweep-plan.json"
    grid = json.loads(plan.read_text())["grid"] if plan.is_file() else rung.lrs
    phases = {"sweep": len(arms) * len(grid) * rung.sweep_seeds,
              "compare": len(arms) * rung.seeds}
    runs = sum(phases.values())
    c = cfgs[arms[0]]
    t = c.train
    tokens = t.max_steps * t.micro_batch * t.grad_accum * c.model.block_size
    flops = sum(flops_per_token(cfgs[a].model) for a in arms) / len(arms) * tokens * runs
    done = 0
    for phase, n in phases.items():
        d = out / rung.name / phase
        done += min(n, sum(1 for _ in d.rglob(runfiles.SUMMARY))) if d.is_dir() else 0
    # processes: a stack trains up to rung.stack seeds of one arm at one lr in one
    processes = (len(arms) * len(grid) * math.ceil(rung.sweep_seeds / rung.stack)
                 + len(arms) * math.ceil(rung.seeds / rung.stack))
    return {"runs": runs, "done": done, "tokens_per_run": tokens, "flops": flops, "cfg": c,
            "processes": processes}


def measure_tok_s(cfg, threads: int, steps: int = 4) -> float:
    """Training tokens/s of one run of cfg on this machine (forward, backward, AdamW step on
    random tokens; the first step is a warm-up and not timed)."""
    import torch

    from nlq.model import Transformer
    from nlq.run.memory import check_fits

    check_fits(cfg, torch.device("cpu"))  # one line naming the key, not an allocator error
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = Transformer(cfg.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        b, T = cfg.train.micro_batch, cfg.model.block_size
        x = torch.randint(0, cfg.model.vocab_size, (b, T))
        for i in range(steps + 1):
            if i == 1:
                t0 = time.perf_counter()
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return steps * b * T / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)


def print_plan(ladder: Ladder, names: list[str], out: Path, jobs: int | None,
               threads: int) -> None:
    """jobs None: --jobs auto on a GPU, sized per rung when it runs (the hours below are
    then those of one run at a time, an upper bound)."""
    shown = jobs if jobs is not None else "auto (from GPU memory; hours below for 1)"
    jobs = jobs or 1
    print(f"study: {len(names)} rung(s) of {ladder.experiment}, arms "
          f"{', '.join(ladder.arms) or 'all'}; {shown} run(s) at a time here")
    total_h = 0.0
    for n in names:
        r = ladder.rungs[n]
        c = rung_cost(ladder, r, out)
        left = c["runs"] - c["done"]
        tok_s = measure_tok_s(c["cfg"], threads)
        hours = left * c["tokens_per_run"] / (tok_s * jobs) / 3600
        gpu_h = c["flops"] * left / c["runs"] / (GPU_MFU * H100_BF16_TFLOPS * 1e12) / 3600
        total_h += hours if r.device == "cpu" else 0.0
        stacked = (f" in {c['processes']} stacked processes (stack {r.stack})"
                   if r.stack > 1 else "")
        print(f"- {n} ({r.description or r.preset}; {r.device}): {c['runs']} runs{stacked} "
              f"({c['done']} finished), {c['tokens_per_run'] / 1e6:.2f}M tokens per run, "
              f"{c['flops']:.3g} FLOPs; here ~{tok_s:,.0f} tok/s per run -> ~{hours:.1f} h "
              f"left; one H100 at {GPU_MFU:.0%} MFU: {gpu_h * 60:.2g} GPU-min left (a FLOP "
              f"bound: models this small reach far less)")
    print(f"study: ~{total_h:.1f} h of CPU rungs left on this machine (more if a sweep's grid "
          f"has to grow)")


# ---------------------------------------------------------------------------------------
# running


def run_rung(ladder: Ladder, rung: Rung, out: Path, jobs: int | None, threads: int = 1,
             launcher: str = "local", after_phase=lambda: None, after_run=None) -> int:
    """Sweep (growing the grid while a best lr sits at its edge), then the seeds;
    after_phase() after each sweep pass and after the seeds, after_run(run_dir) as each run
    finishes (the study's --export)."""
    check_rung(out, rung_record(ladder, rung))
    arms = ladder.arms or None
    lrs = list(rung.lrs)
    # each pass grows a side by one step, at most log_step(MAX_WIDEN) steps a side
    for _ in range(2 * round(math.log(MAX_WIDEN) / math.log(grid_step(lrs))) + 1):
        rc = sweep(ladder.experiment, rung.preset, arms, lrs, rung.sweep_seeds, out / "sweep",
                   jobs, rung.sets, threads, launcher, rung.stack, after_run)
        after_phase()
        if rc != 0:
            return rc
        result = json.loads((out / "sweep" / RESULT_FILE).read_text())
        grown = widen(lrs, result["fit"], rung.lrs)
        if grown == lrs:
            break
        print(f"study: {rung.name}: a best lr lies at the grid's edge; growing the grid to "
              f"{', '.join(f'{v:.4g}' for v in grown)}", file=sys.stderr)
        lrs = grown
    rc = reproduce(ladder.experiment, rung.preset, rung.seeds, arms, out / "compare", jobs,
                   force=False, sets=rung.sets, lrs_from=out / "sweep" / RESULT_FILE,
                   threads=threads, launcher=launcher, stack=rung.stack, after_run=after_run)
    after_phase()
    return rc


def widen(lrs: list[float], chosen: dict, declared: list[float]) -> list[float]:
    """lrs grown by one grid step (x2 or x sqrt(2)) on each side where some arm's lowest grid
    point is the edge (sweep.json's fit.<arm>.grid_best), to at most MAX_WIDEN times beyond
    the declared grid."""
    step = grid_step(declared)
    limit = round(math.log(MAX_WIDEN) / math.log(step))  # steps per side
    best = {c["grid_best"] for c in chosen.values()}
    lo_steps = round(math.log(declared[0] / lrs[0]) / math.log(step))
    hi_steps = round(math.log(lrs[-1] / declared[-1]) / math.log(step))
    out = list(lrs)
    if lrs[0] in best and lo_steps < limit:
        out.insert(0, lrs[0] / step)
    if lrs[-1] in best and hi_steps < limit:
        out.append(lrs[-1] * step)
    return out


def study(ladder_path: str | Path | None, names: list[str] | None, out: Path, jobs: int | None,
          force: bool = False, dry_run: bool = False, threads: int = 1,
          launcher: str = "local", export: Path | None = None) -> int:
    """export: a folder that receives each run as it finishes and `nlq export OUT` (every
    finished run and the reports, no checkpoints) after every phase of every rung and when
    the study stops, so a study cut off by a time limit (a GPU loan, a job's wall clock, a
    SIGKILL) has lost no finished run."""
    import torch

    from nlq.experiments.study_report import build_study_report
    from nlq.report.export import export_results, export_run

    check_out(out, "study")  # a folder of the user's is refused before any work
    if export is not None:
        e, o = Path(export).resolve(), out.resolve()
        if e == o or o in e.parents or e in o.parents:
            raise NlqError(f"--export {export}: give a folder neither inside nor above --out "
                           f"{out}")
    ladder = load_ladder(ladder_path)
    experiment_path(ladder.experiment)  # an unknown experiment fails before any work
    names = names or [n for n, r in ladder.rungs.items() if r.device == "cpu"]
    unknown = [n for n in names if n not in ladder.rungs]
    if unknown:
        raise NlqError(f"--rungs: unknown rung {unknown[0]!r} (the ladder has "
                       f"{', '.join(ladder.rungs)})")
    for n in names:  # no rung changed, before any training (load_ladder resolved each config)
        r = ladder.rungs[n]
        if (out / n / RUNG_FILE).is_file():
            check_rung(out / n, rung_record(ladder, r), write=not dry_run)
    gpu = [n for n in names if ladder.rungs[n].device == "cuda"]
    if gpu and not dry_run and not force and not torch.cuda.is_available():
        # before any run: --jobs auto would size a GPU's share, and hours of CPU would go to
        # a rung sized for a GPU
        raise NlqError(f"rung {gpu[0]} needs a CUDA GPU and none is visible here: run `nlq "
                       f"study --rungs {','.join(gpu)}` on a GPU machine (see --dry-run for "
                       f"its cost), or add --force to train it on this CPU")
    print_plan(ladder, names, out, jobs, threads)
    if dry_run:
        return 0
    def report():
        build_study_report(ladder, out)
        if export is not None:
            export_results(out, export)

    def export_one(run_dir: Path):  # a kill (a time limit's) then loses no finished run
        export_run(out, run_dir, export)

    rc = 0
    for n in names:
        r = ladder.rungs[n]
        print(f"study: rung {n}: {r.description}", file=sys.stderr)
        try:
            rc = run_rung(ladder, r, out / n, jobs, threads, launcher, after_phase=report,
                          after_run=export_one if export is not None else None) or rc
        finally:  # after every rung, and when a signal stopped it: its finished runs show
            report()
    report()
    return rc
