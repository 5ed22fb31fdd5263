"""The arms of report.json: one row per arm, with its config, its statistics over seeds
(nlq.report.stats.mean_ci) and its paired comparison against the baseline, described
(nlq.report.verdicts.describe); the baseline first, then the others by name."""

from __future__ import annotations

import math
from collections.abc import Sequence

from nlq.config import flatten
from nlq.report.runs import Run, final
from nlq.report.stats import mean_ci, paired
from nlq.report.verdicts import describe


def arm_rows(by_arm: dict[str, list[Run]], baseline: str, family: set) -> dict[str, dict]:
    """{arm: its row}, the baseline first; family: the (arm, against) pairs that get
    verdicts (see _arm_stats)."""
    rows: dict[str, dict] = {}
    base_row = None
    for a in _arm_order(list(by_arm), baseline):
        rows[a] = _arm_stats(a, by_arm[a], by_arm.get(baseline), base_row, baseline, family)
        if a == baseline:
            base_row = rows[a]
            for k in ("params_total", "params_non_embedding"):
                base_row[f"{k}_vs_baseline_pct"] = 0.0 if isinstance(base_row[k], int) else None
    return rows


def _arm_order(arms: Sequence[str], baseline: str) -> list[str]:
    return sorted(set(arms), key=lambda a: (a != baseline, a))


def _config_diffs(runs: list[Run]) -> list[str]:
    """Config keys (other than the seeds and the device) that differ between an arm's runs."""
    ignore = {"train.seed", "data.seed", "train.device"}
    flat = [flatten(r.cfg.to_dict()) for r in runs]
    return sorted(k for k in flat[0] if k not in ignore and len({repr(f.get(k)) for f in flat}) > 1)


def _pct_vs(n: int | None, base: int | None) -> float | None:
    if n is None or not base:
        return None
    return 100.0 * (n - base) / base


def _arm_stats(name: str, runs: list[Run], base_runs: list[Run] | None, base_row: dict | None,
               baseline: str, family: set) -> dict:
    """An arm's row; family: the (arm, against) pairs that get verdicts (the pre-registered
    comparisons and the positive control), whose row against the baseline is described
    without the note that it is outside them."""
    cfg = runs[0].cfg
    losses = [r.final_loss for r in runs]  # test where every run has it, else val
    vals = [float(r.summary["val_loss"]) for r in runs]
    ppls = [math.exp(x) for x in losses]
    params_total = sorted({r.summary.get("params_total") for r in runs}, key=str)
    params_ne = sorted({r.summary.get("params_non_embedding") for r in runs}, key=str)
    tokens = sorted({r.tokens for r in runs}, key=str)
    steps = sorted({r.summary.get("step") for r in runs}, key=str)
    row = {
        "arm": name,
        "label": next((r.label for r in runs if r.label), None),
        "experiments": sorted({r.experiment for r in runs if r.experiment}),
        "query": cfg.model.query,
        "qk_norm": cfg.model.qk_norm,
        "mlp_width": cfg.model.mlp_width,
        "lr": cfg.train.lr,
        "weight_decay": cfg.train.weight_decay,
        "params_total": params_total[0] if len(params_total) == 1 else params_total,
        "params_non_embedding": params_ne[0] if len(params_ne) == 1 else params_ne,
        "n_seeds": len(runs),
        "seeds": [r.seed for r in runs],
        "train_seeds": sorted({r.cfg.train.seed for r in runs}),
        "data_seeds": sorted({r.cfg.data.seed for r in runs}),
        "steps": steps[0] if len(steps) == 1 else steps,
        "tokens_per_step": runs[0].tokens_per_step,
        "tokens_per_run": tokens[0] if len(tokens) == 1 else tokens,
        "loss": mean_ci(losses).to_dict(),
        "ppl_mean": sum(ppls) / len(ppls),
        "val_loss": mean_ci(vals).to_dict(),
        "val_ppl_mean": sum(math.exp(x) for x in vals) / len(vals),
        "n_spikes": [int(r.summary.get("n_spikes", 0)) for r in runs],
        "per_seed": [{"seed": r.seed, "run_dir": str(r.dir), "loss": r.final_loss,
                      "val_loss": float(r.summary["val_loss"]),
                      "ppl": math.exp(r.final_loss), "tokens": r.tokens,
                      "spikes": r.summary.get("spikes", [])} for r in runs],
        "config_differs_in": _config_diffs(runs),
    }
    if base_row is not None:
        for k in ("params_total", "params_non_embedding"):
            v, b = row[k], base_row[k]
            ok = isinstance(v, int) and isinstance(b, int)
            row[f"{k}_vs_baseline_pct"] = _pct_vs(v, b) if ok else None
    if base_runs is not None and name != baseline:
        pair = paired(final(runs), final(base_runs))
        row["vs_baseline"] = pair.to_dict()
        row["preregistered"] = (name, baseline) in family
        row["descriptive"] = f"{name}: {describe(baseline, pair, not row['preregistered'])}"
    return row
