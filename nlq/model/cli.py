"""`nlq params`: exact parameter counts of a preset's arms."""

from __future__ import annotations

import json

from nlq.config import load_config, parse_sets, preset_path, read_toml, split_arms
from nlq.experiments.arms import preset_arms
from nlq.model.params import count_params, pct_vs


def fmt_pct(p: float) -> str:
    if p == 0:
        return "0%"
    return f"{p:+.3f}%"


def params_table(preset: str, sets=None) -> list[dict]:
    # a preset without [arms] is one arm: its own config
    arms = preset_arms(preset, sets) or {preset: load_config(preset, sets)}
    _, raw_arms = split_arms(read_toml(preset_path(preset)))
    rows = []
    for name, cfg in arms.items():
        total, non_emb = count_params(cfg.model)
        rows.append({"name": name, "query": cfg.model.query, "mlp_hidden": cfg.model.mlp_width,
                     "total": total, "non_embedding": non_emb,
                     "computed": "grow_non_embedding_pct" in raw_arms.get(name, {})})
    base = next((r for r in rows if r["name"] == "linear"), rows[0])["non_embedding"]
    for r in rows:
        r["vs_baseline_pct"] = round(pct_vs(r["non_embedding"], base), 3)
    return rows


def add_arguments(p) -> None:
    p.add_argument("--preset", default="gpt3-small", help="preset name (default: gpt3-small)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every arm, e.g. model.n_layer=6")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    rows = params_table(args.preset, parse_sets(args.set))
    if args.json:
        keys = ("name", "query", "mlp_hidden", "total", "non_embedding", "vs_baseline_pct")
        print(json.dumps({"preset": args.preset, "arms": [{k: r[k] for k in keys} for r in rows]}))
        return 0
    print(f"preset {args.preset}: non-embedding = total minus token and position embeddings")
    print("| arm | MLP | total | non-embedding | vs linear |")
    print("|---|---|---|---|---|")
    for r in rows:
        vs = "-" if r["name"] == "linear" else fmt_pct(r["vs_baseline_pct"])
        name = r["name"].replace("+", " +") + " (computed)" if r["computed"] else r["name"]
        print(f"| {name} | {r['mlp_hidden']} | {r['total']:,} | "
              f"{r['non_embedding']:,} | {vs} |")
    return 0


COMMANDS = {"params": ("print parameter counts of a preset's arms", add_arguments, run)}
