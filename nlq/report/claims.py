"""What an experiment declares about its outcome, for the report to check and show: the
ordering of arms it expects ([hypothesis]) and the published figures it is set beside
([reference]).

hypothesis.comparisons is the Holm family: the only comparisons the report gives a verdict
on (nlq/report/compare.py); the ordering and the QK-norm question are read from their outcomes
and the positive control's, and every other pair of arms is only described. An experiment
that wants another pair judged lists it there.

Both are tables of the experiment's TOML; nlq/experiments/paper.toml holds the paper's
(docs/paper.md, "The paper's numbers"). `nlq reproduce` writes the resolved experiment to
OUT/experiment.toml, where `nlq report OUT` finds them. Without them a report has no
ordering line and no reference section.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nlq.config import read_toml
from nlq.errors import NlqError

EXPERIMENT_FILE = "experiment.toml"  # the resolved experiment, in an experiment's output dir

# A row of [[reference.figures]]: label strings, numbers, and a flag for the baseline row.
FIGURE_KEYS = {"version": str, "arm": str, "val_loss": float, "log_loss_pct": float,
               "ppl_pct": float, "baseline": bool}


@dataclass(frozen=True)
class Claims:
    ordering: tuple[str, ...] = ()
    """Arms in the expected order of final log-loss, lowest first."""
    reference: dict | None = None
    """cite, setting and figures: the published numbers, another scale than ours."""
    comparisons: tuple[tuple[str, str], ...] = ()
    """Pre-registered (arm, against) pairs: the Holm family, the only pairs given verdicts."""
    positive_control: tuple[str, str] | None = None
    """(arm, against): the first must beat the second, its 95% interval excluding 0, before
    any verdict (e.g. more parameters must help where a capacity claim is tested)."""


HYPOTHESIS_KEYS = ("ordering", "comparisons", "positive_control")


def claims_from_dict(raw: dict, where: str) -> Claims:
    """The [hypothesis] and [reference] tables of an experiment (its other keys are ignored)."""
    hyp = raw.get("hypothesis", {})
    if not isinstance(hyp, dict) or set(hyp) - set(HYPOTHESIS_KEYS):
        bad = sorted(set(hyp) - set(HYPOTHESIS_KEYS)) if isinstance(hyp, dict) else [hyp]
        raise NlqError(f"{where}: [hypothesis] holds {', '.join(HYPOTHESIS_KEYS)}; got "
                       f"{bad[0]!r}")
    order = hyp.get("ordering", [])
    if not _names(order) or (order and (len(order) < 2 or len(set(order)) < len(order))):
        raise NlqError(f"{where}: hypothesis.ordering must list 2 or more distinct arm names, "
                       f"got {order!r}")
    comps = hyp.get("comparisons", [])
    if not isinstance(comps, list) or not all(_pair(c) for c in comps):
        raise NlqError(f"{where}: hypothesis.comparisons must list [arm, against] pairs of "
                       f"two distinct arm names, got {comps!r}")
    control = hyp.get("positive_control")
    if control is not None and not _pair(control):
        raise NlqError(f"{where}: hypothesis.positive_control must be [arm, against], two "
                       f"distinct arm names, got {control!r}")
    ref = raw.get("reference")
    if ref is not None:
        _check_reference(ref, where)
    return Claims(tuple(order), ref, tuple(tuple(c) for c in comps),
                  tuple(control) if control else None)


def check_arms(claims: Claims, arms, where: str) -> None:
    """Every arm a claim names must be one of the experiment's arms."""
    named = [*claims.ordering, *(a for c in claims.comparisons for a in c),
             *(claims.positive_control or ())]
    unknown = [a for a in named if a not in arms]
    if unknown:
        raise NlqError(f"{where}: [hypothesis] names arm {unknown[0]!r}, which is not one of "
                       f"its arms ({', '.join(arms)})")


def _names(x) -> bool:
    return isinstance(x, list) and all(isinstance(a, str) for a in x)


def _pair(x) -> bool:
    return _names(x) and len(x) == 2 and x[0] != x[1]


def _check_reference(ref, where: str) -> None:
    if not isinstance(ref, dict) or set(ref) != {"cite", "setting", "figures"}:
        odd = sorted(set(ref) ^ {"cite", "setting", "figures"}) if isinstance(ref, dict) else []
        raise NlqError(f"{where}: [reference] holds cite, setting and [[reference.figures]]"
                       + (f" (unknown or missing: {', '.join(odd)})" if odd else ""))
    if not isinstance(ref["cite"], str) or not isinstance(ref["setting"], str):
        raise NlqError(f"{where}: reference.cite and reference.setting must be strings")
    if not isinstance(ref["figures"], list) or not ref["figures"]:
        raise NlqError(f"{where}: reference.figures must be a list of tables")
    for i, row in enumerate(ref["figures"]):
        if not isinstance(row, dict) or not {"version", "arm"} <= set(row):
            raise NlqError(f"{where}: reference.figures[{i}] needs version and arm")
        for k, v in row.items():
            tp = FIGURE_KEYS.get(k)
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if tp is None or not (number if tp is float else isinstance(v, tp)):
                raise NlqError(f"{where}: reference.figures[{i}].{k} = {v!r} (known keys: "
                               f"{', '.join(FIGURE_KEYS)}; numbers for the figures)")


def find_claims(paths: Iterable[Path], run_dirs: Iterable[Path]) -> Claims:
    """The claims of the experiment the runs belong to: experiment.toml in a given folder, or
    in the experiment folder above a run dir laid out as OUT/runs/<arm>/seed<k>/."""
    files = {p / EXPERIMENT_FILE for p in map(Path, paths)}
    files |= {d.parents[2] / EXPERIMENT_FILE for d in run_dirs
              if len(d.parents) > 2 and d.parent.parent.name == "runs"}
    found: dict[Path, Claims] = {}
    for f in sorted(files):
        if f.is_file():
            found[f] = claims_from_dict(read_toml(f), str(f))
    distinct = {repr(c): c for c in found.values()}
    if len(distinct) > 1:
        raise NlqError(f"the runs belong to experiments that declare different claims "
                       f"({', '.join(map(str, found))}): choose one with --experiment")
    return next(iter(distinct.values()), Claims())
