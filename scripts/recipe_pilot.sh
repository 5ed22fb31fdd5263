#!/usr/bin/env bash
# The recipe pilot (docs/experiments.md, 2026-12-04): which shared recipe knobs make the
# `small` comparison stable under float rounding? Each recipe trains linear and nonlinear
# (same recipe, weight decay included) for 4 seeds at 1 thread, then seeds 0 and 1 again at 2
# threads (numerical replicates), and is exported to results/recipe-pilot/<recipe>/.
# Finished runs are skipped, so the script continues where it stopped.
# Usage: bash scripts/recipe_pilot.sh [RECIPE ...]   (default: every recipe, in order)
set -euo pipefail
cd "$(dirname "$0")/.."
NLQ=${NLQ:-.venv/bin/nlq}
declare -A RECIPES=(
  [lr2.4e-2-wu100]="train.lr=2.4e-2 train.min_lr=2.4e-3 train.warmup_steps=100"
  [lr2.4e-2-wu500]="train.lr=2.4e-2 train.min_lr=2.4e-3 train.warmup_steps=500"
  [lr1.2e-2-wu500]="train.lr=1.2e-2 train.min_lr=1.2e-3 train.warmup_steps=500"
  [lr6e-3-wu100]="train.lr=6e-3 train.min_lr=6e-4 train.warmup_steps=100"
  [lr1.2e-2-wu500-min1e-4]="train.lr=1.2e-2 train.min_lr=1.2e-4 train.warmup_steps=500"
  [lr2.4e-2-wu100-clip0.5]="train.lr=2.4e-2 train.min_lr=2.4e-3 train.warmup_steps=100 train.grad_clip=0.5"
  [lr2.4e-2-wu100-b2.99]="train.lr=2.4e-2 train.min_lr=2.4e-3 train.warmup_steps=100 train.beta2=0.99"
  # the chosen recipe with grad clip 0.5 / beta2 0.99: do they narrow it further?
  [lr1.2e-2-wu500-min1e-4-clip0.5]="train.lr=1.2e-2 train.min_lr=1.2e-4 train.warmup_steps=500 train.grad_clip=0.5"
  [lr1.2e-2-wu500-min1e-4-b2.99]="train.lr=1.2e-2 train.min_lr=1.2e-4 train.warmup_steps=500 train.beta2=0.99"
)
ORDER=(lr2.4e-2-wu100 lr2.4e-2-wu500 lr1.2e-2-wu500 lr6e-3-wu100 lr1.2e-2-wu500-min1e-4
       lr2.4e-2-wu100-clip0.5 lr2.4e-2-wu100-b2.99 lr1.2e-2-wu500-min1e-4-clip0.5
       lr1.2e-2-wu500-min1e-4-b2.99)
[ "$#" -gt 0 ] && ORDER=("$@")
for r in "${ORDER[@]}"; do
  [ -n "${RECIPES[$r]:-}" ] || { echo "recipe_pilot: unknown recipe $r" >&2; exit 2; }
  sets=(); for kv in ${RECIPES[$r]}; do sets+=(--set "$kv"); done
  out=out/recipe-pilot/$r
  # a run from the committed copy counts as finished: only what is missing is trained
  [ -d "results/recipe-pilot/$r" ] && [ ! -d "$out" ] && mkdir -p out/recipe-pilot && cp -r "results/recipe-pilot/$r" "$out"
  common=(--preset small --arms linear,nonlinear --seeds 4 --out "$out" "${sets[@]}")
  # the seeds 2 at a time, then the replicates one at a time (a 2-thread run fills the cores)
  "$NLQ" reproduce "${common[@]}" --jobs 2 --threads 1 --replicates 2 --replicate-threads 2 \
      || true
  "$NLQ" export "$out" "results/recipe-pilot/$r"
done
