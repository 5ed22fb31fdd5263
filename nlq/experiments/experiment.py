"""Experiments: a TOML file naming its arms (from arms.toml), a [base] of config overrides
applied to every arm on top of the preset, the baseline arm, and what it claims ([hypothesis]
and [reference], read by the report: nlq/report/claims.py).

    name = "paper"
    baseline = "linear"
    arms = ["linear", "nonlinear", "linear+12.5%"]   # or [arms.<name>] recipe tables
    hypothesis = "paper"                             # or a [hypothesis] table; same for reference
    [base]
    model.arch = "encoder"

`nlq reproduce` writes the resolved experiment (arms written out as recipes, claims as
tables) to OUT/experiment.toml: a file load_experiment reads back to the same Experiment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from nlq.config import Config, apply_overrides, flatten, from_dict, load_config, read_toml
from nlq.errors import NlqError
from nlq.experiments.arms import named_arms, recipe, resolve_arm
from nlq.report.claims import Claims, check_arms, claims_from_dict

EXPERIMENT_DIR = Path(__file__).parent
NOT_EXPERIMENTS = ("arms.toml", "ladder.toml")  # the named arms; the study's ladder
KEYS = ("name", "description", "baseline", "arms", "base", "hypothesis", "reference")


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    baseline: str
    base: dict[str, Any]
    """Flat dotted config overrides applied to the preset before any arm."""
    arms: dict[str, dict[str, Any]]
    """name -> recipe (nlq/experiments/arms.py), in the order the runs are planned."""
    claims: Claims


def experiment_path(name_or_file: str | Path) -> Path:
    path = Path(name_or_file)
    if path.is_file():
        return path
    if path.suffix == ".toml" or len(path.parts) > 1:  # a file meant, not a shipped name
        raise NlqError(f"experiment file {path} not found")
    path = EXPERIMENT_DIR / f"{name_or_file}.toml"
    if not path.is_file() or path.name in NOT_EXPERIMENTS:
        raise NlqError(f"unknown experiment {str(name_or_file)!r} (shipped: "
                       f"{', '.join(shipped_experiments())}; or give a TOML file)")
    return path


def shipped_experiments() -> list[str]:
    return sorted(p.stem for p in EXPERIMENT_DIR.glob("*.toml") if p.name not in NOT_EXPERIMENTS)


def load_experiment(name_or_file: str | Path) -> Experiment:
    path = experiment_path(name_or_file)
    raw = read_toml(path)
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise NlqError(f"{path}: unknown key {unknown[0]!r} (an experiment has "
                       f"{', '.join(KEYS)})")
    arms = _arms(raw.get("arms"), path)
    baseline = raw.get("baseline", next(iter(arms)))
    if baseline not in arms:
        raise NlqError(f"{path}: baseline {baseline!r} is not one of its arms "
                       f"({', '.join(arms)})")
    for key in ("hypothesis", "reference"):
        seen = [path.stem]
        while isinstance(raw.get(key), str):  # the claim of another experiment, e.g. "paper"
            if raw[key] in seen:
                raise NlqError(f"{path}: {key} refers back to itself ({' -> '.join(seen)})")
            seen.append(raw[key])
            other = read_toml(experiment_path(raw[key]))
            if key not in other:
                raise NlqError(f"{path}: {key} = {raw[key]!r}, but that experiment declares "
                               f"no {key}")
            raw[key] = other[key]
    base = raw.get("base", {})
    if not isinstance(base, dict):
        raise NlqError(f"{path}: 'base' must be a table of config overrides")
    claims = claims_from_dict(raw, str(path))
    check_arms(claims, arms, str(path))
    return Experiment(raw.get("name", path.stem), raw.get("description", ""), baseline,
                      flatten(base), arms, claims)


def _arms(raw: Any, path: Path) -> dict[str, dict[str, Any]]:
    """A list of arm names from arms.toml, or a table of recipes written out in full."""
    if isinstance(raw, dict) and raw:
        return {name: recipe(r, name) for name, r in raw.items()}
    if isinstance(raw, list) and raw and all(isinstance(a, str) for a in raw):
        known = named_arms()
        unknown = [a for a in raw if a not in known]
        if unknown:
            raise NlqError(f"{path}: unknown arm {unknown[0]!r} (arms.toml defines "
                           f"{', '.join(known)}; or write [arms.<name>] tables)")
        return {a: known[a] for a in raw}
    raise NlqError(f"{path}: 'arms' must list arm names (from nlq/experiments/arms.toml) or "
                   f"hold [arms.<name>] tables, got {raw!r}")


def experiment_arms(exp: Experiment, preset: str, sets: dict | None = None,
                    names: list[str] | None = None) -> dict[str, Config]:
    """The configs of the experiment's arms (or of `names` among them): the preset, then the
    --set overrides, then the experiment's [base], then each arm's recipe. A --set of a key
    that [base] or an arm's recipe sets to another value would be silently undone: an error
    naming both. (An arm's lr_scale multiplies a --set train.lr, on purpose: the recipe scales
    with the preset; its grow_non_embedding_pct grows a --set model.mlp_hidden.)"""
    arms = names or list(exp.arms)
    for key, value in (sets or {}).items():
        owners = [("the experiment's [base]", exp.base)] + [
            (f"arm {a!r}", exp.arms[a]) for a in arms]
        for who, table in owners:
            if key in table and table[key] != value:
                raise NlqError(f"--set {key}={value!r} would be undone: {who} of experiment "
                               f"{exp.name!r} sets {key} = {table[key]!r}; edit the "
                               f"experiment (--experiment FILE) instead")
    base = load_config(preset, sets)
    base = from_dict(apply_overrides(base.to_dict(), exp.base))
    return {a: resolve_arm(base, exp.arms[a], a) for a in arms}


def experiment_toml(exp: Experiment) -> str:
    """The resolved experiment as TOML: every arm's recipe and every claim written out."""
    doc: dict[str, Any] = {"name": exp.name, "description": exp.description,
                           "baseline": exp.baseline, "base": _nest(exp.base),
                           "arms": {a: _nest(r) for a, r in exp.arms.items()}}
    c = exp.claims
    hyp = {"ordering": list(c.ordering), "comparisons": [list(x) for x in c.comparisons],
           "positive_control": list(c.positive_control or ())}
    hyp = {k: v for k, v in hyp.items() if v}
    if hyp:
        doc["hypothesis"] = hyp
    if exp.claims.reference:
        doc["reference"] = exp.claims.reference
    return tomli_w.dumps(doc)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"model.query": q} -> {"model": {"query": q}}: TOML tables instead of quoted keys."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
    return out


def params_table(experiment: str = "paper", preset: str = "gpt3-small",
                 sets: dict | None = None) -> list[dict]:
    """`nlq params`: one row per distinct model among the experiment's arms: an arm whose model
    equals an earlier arm's (it differs in training only, e.g. linear+12.5%-lr) is left out,
    its name kept in the earlier row's same_model."""
    from nlq.model.params import count_params, pct_vs

    exp = load_experiment(experiment)
    rows: list[dict] = []
    for name, cfg in experiment_arms(exp, preset, sets).items():
        twin = next((r for r in rows if r["model"] == cfg.model), None)
        if twin is not None:
            twin["same_model"].append(name)
            continue
        total, non_emb = count_params(cfg.model)
        rows.append({"name": name, "query": cfg.model.query, "mlp_hidden": cfg.model.mlp_width,
                     "total": total, "non_embedding": non_emb, "model": cfg.model,
                     "computed": "grow_non_embedding_pct" in exp.arms[name], "same_model": []})
    base = next((r for r in rows if r["name"] == exp.baseline), rows[0])
    for r in rows:
        r["vs_baseline_pct"] = round(pct_vs(r["non_embedding"], base["non_embedding"]), 3)
        r["baseline"] = r is base
    return rows
