"""A study's ladder (nlq/experiments/ladder.toml, or any TOML of that form), read and checked.

A ladder names an experiment, its arms and rungs; a rung is a preset plus config overrides,
an lr grid, seed counts, its device, tokens per parameter and how many seeds train as one
stacked model. Every key is checked when the ladder is read (load_ladder), each error naming
its key: a bad value is one error here, never a plan of negative runs or a failure hours into
a study (`nlq study`, nlq/experiments/study.py, runs the rungs).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from nlq.config import load_config, read_toml
from nlq.config.load import preset_names
from nlq.errors import NlqError
from nlq.experiments.experiment import load_experiment
from nlq.experiments.sweep import LR_CHOICE, SEED_OFFSET, check_grid


@dataclass(frozen=True)
class Rung:
    name: str
    preset: str
    lrs: list[float]
    sweep_seeds: int = 4
    seeds: int = 8
    sets: dict = field(default_factory=dict)
    device: str = "cpu"  # "cuda": not started on a machine without a CUDA GPU
    description: str = ""
    # training tokens per non-embedding parameter of the baseline: sets train.max_steps (and
    # the warmup in the preset's proportion) in `sets`, so rungs of other sizes train alike
    tokens_per_param: float | None = None
    # seeds of one arm (and lr) trained as one stacked model (nlq/train/stack.py): part of
    # the rung's recipe, since stacked runs sum their floats in another order than lone runs
    stack: int = 1


@dataclass(frozen=True)
class Ladder:
    experiment: str  # a shipped experiment's name or a TOML file
    arms: list[str]
    rungs: dict[str, Rung]


def load_ladder(path: str | Path | None = None) -> Ladder:
    """A ladder with every key checked, each error naming it: a bad value is one error here,
    never a plan of negative runs or a failure hours into a study."""
    path = Path(path) if path else Path(__file__).with_name("ladder.toml")
    raw = read_toml(path)
    unknown = set(raw) - {"experiment", "arms", "rungs"}
    if unknown:
        raise NlqError(f"ladder {path}: unknown key {min(unknown)!r}")
    if not isinstance(raw.get("rungs"), dict) or not raw["rungs"]:
        raise NlqError(f"ladder {path}: no [rungs.<name>] table")
    exp = raw.get("experiment", "paper")
    if not isinstance(exp, str):
        raise NlqError(f"ladder {path}: experiment must be a name or a TOML file, got {exp!r}")
    if not Path(exp).is_absolute() and exp.endswith(".toml"):
        exp = str(path.parent / exp)  # a file beside the ladder
    try:
        known = load_experiment(exp).arms
    except NlqError as e:
        raise NlqError(f"ladder {path}: experiment: {e}") from None
    arms = raw.get("arms") or []
    if not isinstance(arms, list) or not all(isinstance(a, str) for a in arms):
        raise NlqError(f"ladder {path}: arms must be a list of arm names, got {arms!r}")
    bad = [a for a in arms if a not in known]
    if bad:
        raise NlqError(f"ladder {path}: arms: unknown arm {bad[0]!r} (experiment {exp!r} has "
                       f"{', '.join(known)})")
    rungs = {name: _rung(path, name, r) for name, r in raw["rungs"].items()}
    return Ladder(experiment=exp, arms=arms, rungs=rungs)


def _rung(path: Path, name: str, r) -> Rung:
    keys = {"preset", "lrs", "sweep_seeds", "seeds", "set", "device", "description",
            "tokens_per_param", "stack"}
    where = f"ladder {path}: rungs.{name}"
    if not isinstance(r, dict):
        raise NlqError(f"{where} must be a table ([rungs.{name}])")
    bad = set(r) - keys
    if bad:
        raise NlqError(f"ladder {path}: rung {name!r} has unknown key {min(bad)!r} "
                       f"(known: {', '.join(sorted(keys))})")
    if "preset" not in r or "lrs" not in r:
        raise NlqError(f"ladder {path}: rung {name!r} needs preset and lrs")
    if r["preset"] not in preset_names():
        raise NlqError(f"{where}.preset: unknown preset {r['preset']!r} (presets: "
                       f"{', '.join(preset_names())})")
    if not isinstance(r["lrs"], list):
        raise NlqError(f"{where}.lrs must be a list of learning rates, got {r['lrs']!r}")
    check_grid(r["lrs"], f"{where}.lrs")
    defaults = {f.name: f.default for f in fields(Rung)}
    counts = {k: r.get(k, defaults[k]) for k in ("sweep_seeds", "seeds")}
    for k, v in counts.items():
        # 2 at least: a sweep's choice averages over seeds, the report's intervals need 2
        if not isinstance(v, int) or isinstance(v, bool) or v < 2:
            raise NlqError(f"{where}.{k} must be an integer >= 2, got {v!r}")
    stack = r.get("stack", 1)
    if not isinstance(stack, int) or isinstance(stack, bool) or stack < 1:
        raise NlqError(f"{where}.stack must be an integer >= 1 (seeds trained as one model), "
                       f"got {stack!r}")
    if r.get("device", "cpu") not in ("cpu", "cuda"):
        raise NlqError(f"{where}.device must be cpu or cuda, got {r['device']!r}")
    sets = r.get("set", {})
    if not isinstance(sets, dict):
        raise NlqError(f"{where}.set must be a table of config overrides, got {sets!r}")
    swept = sorted({"train.lr", "train.min_lr"} & set(sets))
    if swept:  # the rung's sweep sets both: a value here would be silently replaced
        raise NlqError(f"{where}.set: {swept[0]} is what the rung's sweep chooses (lrs, and "
                       f"min_lr keeps the preset's ratio to lr): leave it out")
    try:
        cfg = load_config(r["preset"], sets)  # the same validation as --set: names the key
    except NlqError as e:
        raise NlqError(f"{where}.set: {e}") from None
    tpp = r.get("tokens_per_param")
    if tpp is not None:
        both = sorted({"train.max_steps", "train.warmup_steps"} & set(sets))
        if both:
            raise NlqError(f"{where}: tokens_per_param sets {both[0]}; give one or the other")
        sets = {**sets, **steps_for(cfg, tpp, where)}
    desc = r.get("description", "")
    if not isinstance(desc, str):
        raise NlqError(f"{where}.description must be a string, got {desc!r}")
    return Rung(name=name, preset=r["preset"], lrs=[float(x) for x in r["lrs"]],
                sweep_seeds=counts["sweep_seeds"], seeds=counts["seeds"], sets=dict(sets),
                device=r.get("device", "cpu"), description=desc,
                tokens_per_param=None if tpp is None else float(tpp), stack=stack)


def steps_for(cfg, tokens_per_param, where: str) -> dict:
    """The overrides that train cfg's model (the baseline: the preset with the rung's set) on
    tokens_per_param tokens per non-embedding parameter: train.max_steps, and
    train.warmup_steps in the preset's proportion of warmup to steps (the recipe pilot's
    warmup 500 of 2,000 steps: docs/experiments.md)."""
    from nlq.model.params import count_params

    if (not isinstance(tokens_per_param, (int, float)) or isinstance(tokens_per_param, bool)
            or not math.isfinite(tokens_per_param) or tokens_per_param <= 0):
        raise NlqError(f"{where}.tokens_per_param must be a positive number, got "
                       f"{tokens_per_param!r}")
    t = cfg.train
    per_step = t.micro_batch * t.grad_accum * cfg.model.block_size
    steps = round(tokens_per_param * count_params(cfg.model)[1] / per_step)
    if steps < 2:
        raise NlqError(f"{where}.tokens_per_param = {tokens_per_param!r} gives {steps} "
                       f"step(s) of {per_step:,} tokens: too few to train")
    return {"train.max_steps": steps,
            "train.warmup_steps": max(1, round(steps * t.warmup / t.max_steps))}


RUNG_FILE = "rung.json"  # OUT/<rung>/rung.json: the record a study started the rung with


def rung_record(ladder: Ladder, rung: Rung) -> dict:
    """What fixes a rung's numbers: written once, compared on every resume."""
    exp = load_experiment(ladder.experiment)
    rec = {"experiment": exp.name, "arms": ladder.arms, **asdict(rung),
           # how the sweep chose: a rung swept otherwise (other seeds, another rule) has
           # other lrs, so other comparison runs
           "sweep_seed_offset": SEED_OFFSET, "lr_choice": LR_CHOICE}
    rec.pop("description")  # words only: may change
    if rec["stack"] == 1:  # lone runs: the record of a rung from before stacks existed
        rec.pop("stack")
    return rec
