"""`nlq study`: the fair comparison at every rung of a ladder of model sizes.

A ladder (nlq/experiments/ladder.toml, or any TOML of that form) names an experiment, its arms
and rungs; a rung is a preset plus config overrides, an lr grid and seed counts. For each rung
the study runs `nlq sweep` (every arm at every lr, chosen on val; when an arm's best lr lies
at an edge of the grid, the grid grows by one x2 step on that side, at most MAX_WIDEN times)
and then `nlq reproduce --lrs-from` (the seeds, scored on the test split, positive control
first), under OUT/<rung>/sweep and OUT/<rung>/compare. Both skip finished runs and resume
killed ones, so a study can be stopped and continued across days. Each rung's definition is
written to OUT/<rung>/rung.json when it starts; a different definition on resume is refused.
The study report (nlq/experiments/study_report.py) is rebuilt from the rungs' reports at the
end of every invocation.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nlq.config import load_config, read_toml
from nlq.errors import NlqError
from nlq.experiments.experiment import experiment_arms, experiment_path, load_experiment
from nlq.experiments.reproduce import reproduce
from nlq.experiments.sweep import RESULT_FILE, sweep
from nlq.fsutil import write_atomic
from nlq.model.params import flops_per_token

MAX_WIDEN = 2  # extra x2 steps a sweep's grid may grow by, per side, when its best is an edge
RUNG_FILE = "rung.json"
H100_BF16_TFLOPS, GPU_MFU = 989.0, 0.40  # the GPU estimate's assumptions, printed with it


@dataclass(frozen=True)
class Rung:
    name: str
    preset: str
    lrs: list[float]
    sweep_seeds: int = 2
    seeds: int = 8
    sets: dict = field(default_factory=dict)
    device: str = "cpu"  # "cuda": not started on a machine without a CUDA GPU
    description: str = ""


@dataclass(frozen=True)
class Ladder:
    experiment: str  # a shipped experiment's name or a TOML file
    arms: list[str]
    rungs: dict[str, Rung]


def load_ladder(path: str | Path | None = None) -> Ladder:
    path = Path(path) if path else Path(__file__).with_name("ladder.toml")
    raw = read_toml(path)
    unknown = set(raw) - {"experiment", "arms", "rungs"}
    if unknown:
        raise NlqError(f"ladder {path}: unknown key {min(unknown)!r}")
    if not isinstance(raw.get("rungs"), dict) or not raw["rungs"]:
        raise NlqError(f"ladder {path}: no [rungs.<name>] table")
    exp = str(raw.get("experiment", "paper"))
    if not Path(exp).is_absolute() and exp.endswith(".toml"):
        exp = str(path.parent / exp)  # a file beside the ladder
    rungs = {}
    keys = {"preset", "lrs", "sweep_seeds", "seeds", "set", "device", "description"}
    for name, r in raw["rungs"].items():
        bad = set(r) - keys
        if bad:
            raise NlqError(f"ladder {path}: rung {name!r} has unknown key {min(bad)!r} "
                           f"(known: {', '.join(sorted(keys))})")
        if "preset" not in r or "lrs" not in r:
            raise NlqError(f"ladder {path}: rung {name!r} needs preset and lrs")
        if r.get("device", "cpu") not in ("cpu", "cuda"):
            raise NlqError(f"ladder {path}: rung {name!r}: device must be cpu or cuda")
        rungs[name] = Rung(name=name, preset=r["preset"], lrs=[float(x) for x in r["lrs"]],
                           sweep_seeds=int(r.get("sweep_seeds", 2)), seeds=int(r.get("seeds", 8)),
                           sets=dict(r.get("set", {})), device=r.get("device", "cpu"),
                           description=r.get("description", ""))
    return Ladder(experiment=exp, arms=list(raw.get("arms") or []), rungs=rungs)


def rung_record(ladder: Ladder, rung: Rung) -> dict:
    """What fixes a rung's numbers: written once, compared on every resume."""
    exp = load_experiment(ladder.experiment)
    rec = {"experiment": exp.name, "arms": ladder.arms, **asdict(rung)}
    rec.pop("description")  # words only: may change
    return rec


def check_rung(out: Path, record: dict) -> None:
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
        if diff:
            k = diff[0]
            raise NlqError(f"{out}: rung {record['name']!r} was started with {k} = "
                           f"{before.get(k)!r}, the ladder now says {record.get(k)!r}: a "
                           f"changed rung is a new rung (give it another name), or use "
                           f"another --out")
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=2))


# ---------------------------------------------------------------------------------------
# cost


def rung_cost(ladder: Ladder, rung: Rung, out: Path) -> dict:
    """Runs, tokens and FLOPs of a rung (before any widening of its grid), and how many of its
    runs have finished."""
    exp = load_experiment(ladder.experiment)
    cfgs = experiment_arms(exp, rung.preset, rung.sets)
    arms = [a for a in cfgs if not ladder.arms or a in ladder.arms]
    runs = len(arms) * (len(rung.lrs) * rung.sweep_seeds + rung.seeds)
    c = cfgs[arms[0]]
    t = c.train
    tokens = t.max_steps * t.micro_batch * t.grad_accum * c.model.block_size
    flops = sum(flops_per_token(cfgs[a].model) for a in arms) / len(arms) * tokens * runs
    done = sum(1 for _ in (out / rung.name).rglob("summary.json")) if out.is_dir() else 0
    return {"runs": runs, "done": min(done, runs), "tokens_per_run": tokens, "flops": flops,
            "cfg": c}


def measure_tok_s(cfg, threads: int, steps: int = 4) -> float:
    """Training tokens/s of one run of cfg on this machine (forward, backward, AdamW step on
    random tokens; the first step is a warm-up and not timed)."""
    import torch

    from nlq.model import Transformer
    from nlq.train.memory import check_fits

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


def print_plan(ladder: Ladder, names: list[str], out: Path, jobs: int, cpu_count: int) -> None:
    threads = max(1, cpu_count // jobs)
    print(f"study: {len(names)} rung(s) of {ladder.experiment}, arms "
          f"{', '.join(ladder.arms) or 'all'}; {jobs} run(s) at a time here")
    total_h = 0.0
    for n in names:
        r = ladder.rungs[n]
        c = rung_cost(ladder, r, out)
        left = c["runs"] - c["done"]
        tok_s = measure_tok_s(c["cfg"], threads)
        hours = left * c["tokens_per_run"] / (tok_s * jobs) / 3600
        gpu_h = c["flops"] * left / c["runs"] / (GPU_MFU * H100_BF16_TFLOPS * 1e12) / 3600
        total_h += hours if r.device == "cpu" else 0.0
        print(f"- {n} ({r.description or r.preset}; {r.device}): {c['runs']} runs "
              f"({c['done']} finished), {c['tokens_per_run'] / 1e6:.2f}M tokens per run, "
              f"{c['flops']:.3g} FLOPs; here ~{tok_s:,.0f} tok/s per run -> ~{hours:.1f} h "
              f"left; one H100 at {GPU_MFU:.0%} MFU: {gpu_h * 60:.2g} GPU-min left (a FLOP "
              f"bound: models this small reach far less)")
    print(f"study: ~{total_h:.1f} h of CPU rungs left on this machine (more if a sweep's grid "
          f"has to grow)")


# ---------------------------------------------------------------------------------------
# running


def run_rung(ladder: Ladder, rung: Rung, out: Path, jobs: int) -> int:
    """Sweep (growing the grid while a best lr sits at its edge), then the seeds."""
    check_rung(out, rung_record(ladder, rung))
    arms = ladder.arms or None
    lrs = list(rung.lrs)
    for _ in range(2 * MAX_WIDEN + 1):
        rc = sweep(ladder.experiment, rung.preset, arms, lrs, rung.sweep_seeds, out / "sweep",
                   jobs, rung.sets)
        if rc != 0:
            return rc
        result = json.loads((out / "sweep" / RESULT_FILE).read_text())
        grown = widen(lrs, result["chosen"], rung.lrs)
        if grown == lrs:
            break
        print(f"study: {rung.name}: a best lr lies at the grid's edge; growing the grid to "
              f"{', '.join(f'{v:.4g}' for v in grown)}", file=sys.stderr)
        lrs = grown
    return reproduce(ladder.experiment, rung.preset, rung.seeds, arms, out / "compare", jobs,
                     force=False, sets=rung.sets, lrs_from=out / "sweep" / RESULT_FILE)


def widen(lrs: list[float], chosen: dict, declared: list[float]) -> list[float]:
    """lrs grown by one x2 step on each side where some arm's best lr is the edge, within
    MAX_WIDEN steps beyond the declared grid."""
    best = {c["lr"] for c in chosen.values()}
    lo_steps = round(math.log2(declared[0] / lrs[0]))
    hi_steps = round(math.log2(lrs[-1] / declared[-1]))
    out = list(lrs)
    if lrs[0] in best and lo_steps < MAX_WIDEN:
        out.insert(0, lrs[0] / 2)
    if lrs[-1] in best and hi_steps < MAX_WIDEN:
        out.append(lrs[-1] * 2)
    return out


def study(ladder_path: str | Path | None, names: list[str] | None, out: Path, jobs: int,
          force: bool = False, dry_run: bool = False) -> int:
    import os

    import torch

    from nlq.experiments.study_report import build_study_report

    ladder = load_ladder(ladder_path)
    experiment_path(ladder.experiment)  # an unknown experiment fails before any work
    names = names or [n for n, r in ladder.rungs.items() if r.device == "cpu"]
    unknown = [n for n in names if n not in ladder.rungs]
    if unknown:
        raise NlqError(f"--rungs: unknown rung {unknown[0]!r} (the ladder has "
                       f"{', '.join(ladder.rungs)})")
    for n in names:  # every rung's configs resolve, and none changed, before any training
        r = ladder.rungs[n]
        load_config(r.preset, r.sets)
        if (out / n / RUNG_FILE).is_file():
            check_rung(out / n, rung_record(ladder, r))
    print_plan(ladder, names, out, jobs, os.cpu_count() or 1)
    if dry_run:
        return 0
    rc = 0
    for n in names:
        r = ladder.rungs[n]
        if r.device == "cuda" and not torch.cuda.is_available() and not force:
            print(f"study: {n} needs a CUDA GPU (none here): skipped; run `nlq study --rungs "
                  f"{n}` on a GPU machine, or add --force", file=sys.stderr)
            continue
        print(f"study: rung {n}: {r.description}", file=sys.stderr)
        rc = run_rung(ladder, r, out / n, jobs) or rc
        build_study_report(ladder, out)  # after every rung: a study stopped later shows it
    build_study_report(ladder, out)
    return rc
