"""Seeds trained as one stacked model against one seed trained alone, side by side in one run.

For a rung of the study's ladder (nlq/experiments/ladder.toml: its preset and model, on its
data), each repeat trains, one after another in this process: one seed alone (`nlq train`'s
path, nlq/train/loop.py) and, for each K of --stacks, K seeds as one stacked model
(nlq/train/stack.py), --steps steps each, no eval but the last and no test split. The figure
is run-steps per second: K x steps / seconds of training steps, over the steps after the
first fifth (the warm-up: allocator, cuDNN and compile caches), from each run's own
metrics.jsonl timings (steps only: no eval, no checkpoint). K lone runs one after another
take K times the lone run's time; the ratio stacked / lone is what a stack gains (or loses)
per process. Medians over --repeats, alternating lone and stacks within each repeat.

Expected: on a CPU a stack is no faster (a small model's step is compute-bound there, and
vmap runs CPU attention seed by seed); on a GPU a small model's step is launch-bound (the
study's d=256 rung took 6.5-9.3 ms a step of 2,048 tokens alone, MFU < 1%: RESULTS.md, the
GPU section) and a stack of K runs its kernels once for K seeds.

Usage: python benchmarks/stack_bench.py [--rung S0] [--stacks 2,4] [--steps 100]
       [--repeats 3] [--allow-dirty] [--results-dir DIR]
Writes benchmarks/results/stack_bench-<date>-<commit>.json (benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import record


def steps_per_s(run_dir: Path) -> float:
    """Optimizer steps per second of a run after its first fifth, from its train rows."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    last = rows[-1]
    first = next(r for r in rows if r["step"] >= last["step"] // 5)
    return (last["step"] - first["step"]) / (last["elapsed"] - first["elapsed"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rung", default="S0", help="a rung of the shipped ladder (default S0)")
    ap.add_argument("--stacks", default="2,4", help="stack sizes K (default 2,4)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    record.add_arguments(ap)
    args = ap.parse_args()
    stacks = [int(k) for k in args.stacks.split(",")]
    if min(stacks) < 2 or args.steps < 20 or args.repeats < 1:
        raise SystemExit("stack_bench: --stacks of 2 or more, --steps >= 20, --repeats >= 1")

    import torch

    from nlq.config import load_config
    from nlq.experiments.ladder import load_ladder
    from nlq.train.loop import train
    from nlq.train.stack import train_stack

    ladder = load_ladder()
    if args.rung not in ladder.rungs:
        raise SystemExit(f"stack_bench: unknown rung {args.rung!r} ({', '.join(ladder.rungs)})")
    rung = ladder.rungs[args.rung]
    sets = {**rung.sets, "train.max_steps": args.steps, "train.warmup_steps": args.steps // 10,
            "train.eval_interval": args.steps, "train.ckpt_interval": args.steps,
            "train.eval_batches": 1, "train.test_eval": False, "train.log_interval": 1}
    cfg = load_config(rung.preset, sets)
    if not (Path(cfg.data.dir) / "meta.json").is_file():
        raise SystemExit(f"stack_bench: no data at {cfg.data.dir}: prepare it first (`nlq "
                         f"prepare`, as the {rung.preset} preset's README section says)")
    rec = record.Recorder("stack_bench", args)  # refuses a dirty tree before measuring
    cfgs = [cfg.replace(**{"train.seed": cfg.train.seed + k, "data.seed": cfg.data.seed + k})
            for k in range(max(stacks))]
    speeds: dict[str, list[float]] = {"lone": [], **{f"stack{k}": [] for k in stacks}}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{args.rung} ({rung.description}), {args.steps} steps, {device}, "
          f"{torch.get_num_threads()} threads; run-steps/s after the first fifth")
    stopped = None
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            # a signal (a time limit's SIGTERM) stops a run at a step boundary and returns:
            # its speed is not a measurement, and no later run starts
            summary = train(cfgs[0], Path(tmp) / "lone", progress=False)
            if summary.get("status") != "finished":
                stopped = f"repeat {rep + 1}, the lone run"
                break
            speeds["lone"].append(steps_per_s(Path(tmp) / "lone"))
            for k in stacks:
                dirs = [Path(tmp) / f"stack{k}" / f"seed{i}" for i in range(k)]
                if any(s.get("status") != "finished"
                       for s in train_stack(cfgs[:k], dirs, progress=False)):
                    stopped = f"repeat {rep + 1}, the stack of {k}"
                    break
                speeds[f"stack{k}"].append(k * steps_per_s(dirs[0]))
        if stopped:
            print(f"stack_bench: stopped by a signal in {stopped}: writing the complete "
                  f"repeats only", file=sys.stderr)
            break
        print(f"repeat {rep + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in speeds.items()),
              file=sys.stderr)
    n = len(speeds[f"stack{stacks[-1]}"])  # complete repeats: every variant measured
    speeds = {name: v[:n] for name, v in speeds.items()}
    if not n:
        rec.write({"rung": args.rung, "steps": args.steps, "device": device,
                   "threads": torch.get_num_threads(), "rows": [], "stopped": stopped})
        return 1
    lone = statistics.median(speeds["lone"])
    rows = []
    for name, v in speeds.items():
        med = statistics.median(v)
        ratios = [s / lo for s, lo in zip(v, speeds["lone"])]
        rows.append({"variant": name, "run_steps_per_s": med, "all": v,
                     "vs_lone": statistics.median(ratios)})
        print(f"{name:>8}: {med:8.1f} run-steps/s  ({med / lone:.2f}x lone; per repeat "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")
    rec.write({"rung": args.rung, "steps": args.steps, "device": device,
               "threads": torch.get_num_threads(), "rows": rows, "stopped": stopped})
    return 1 if stopped else 0


if __name__ == "__main__":
    raise SystemExit(main())
