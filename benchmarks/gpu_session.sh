#!/usr/bin/env bash
# Every GPU figure of benchmarks/RESULTS.md's GPU section and the GPU tests, in one go, in
# at most 9 minutes on one H200 (a GPU lent for a short while: one script, run once).
#
#   NLQ_OFFICIAL_MODEL=path/of/official/model.py bash benchmarks/gpu_session.sh [OUT_DIR]
#
# NLQ_OFFICIAL_MODEL: model.py of github.com/MarkoKarbevski/beyond_query_linearity (not shipped
# here; carry a copy to a machine without network); without it the official-* rows are left out.
#
# 1. meanwhile: the GPU tests (pytest -m gpu) and torch.compile's caches warmed for every
#    compiled variant, NLQ_WARM_JOBS (default 3) processes at a time (compiling is CPU work;
#    nothing is timed yet; each GPT-3 small process holds ~17 GiB, so 4 and the tests may
#    not fit an 80 GB H100);
# 2. alone on the GPU: train_bench at GPT-3 small (12 x 1024, bf16) for nlq's arms eager and
#    compiled, the nanoGPT-style reference and the official code's model alike, the chunked
#    loss and DDP in one process, with each row's top GPU kernels (profile);
# 3. the study's first rung (d=256, 8 x 256): eager, compiled and CUDA graphs.
# Logs and result files go to OUT_DIR (default benchmarks/results). On a copy of the tree whose
# .git is missing or stale (a tree sent to a lent GPU machine) set NLQ_BENCH_COMMIT to the
# clean commit it is (benchmarks/record.py); the tree must be committed first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-benchmarks/results}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
PY=${PYTHON:-python3}
BENCH=benchmarks/train_bench.py
BIG="linear,nonlinear,reference,official-linear,official-nonlinear,linear+modules,nonlinear+modules,linear+compile,nonlinear+compile,reference+compile,official-linear+compile,official-nonlinear+compile,nonlinear+compile+chunked,nonlinear+compile+blocks,linear+compile+ddp"
SMALL="linear,nonlinear,linear+compile,nonlinear+compile,linear+cudagraphs,nonlinear+cudagraphs"
if [ ! -f "${NLQ_OFFICIAL_MODEL:-}" ]; then  # the official rows need its model.py (no network)
    echo "gpu_session: NLQ_OFFICIAL_MODEL is not a file: the official-* rows are left out"
    BIG=$(echo "$BIG" | tr ',' '\n' | grep -v '^official-' | paste -sd, -)
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT_DIR/gpu.txt"

t0=$(date +%s)
timeout 150 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
    > "$OUT_DIR/gpu_tests.log" 2>&1 &
tests=$!
warm() {  # shape variant: one step of it, to fill the compile caches
    timeout 145 "$PY" "$BENCH" --child "$1" "$2" 1 > /dev/null 2>&1 || echo "warm-up $1 $2 failed"
}
export -f warm
export PY BENCH
{
    for v in ${BIG//,/ }; do [[ $v == *compile* && $v != *ddp* ]] && echo "gpt3-small-gpu $v"; done
    for v in ${SMALL//,/ }; do [[ $v == *compile* || $v == *cudagraphs* ]] && echo "r1-gpu $v"; done
} | timeout 150 xargs -P "${NLQ_WARM_JOBS:-3}" -L 1 bash -c 'warm "$0" "$1"'
wait $tests
echo "tests exit $? after $(( $(date +%s) - t0 )) s"
tail -5 "$OUT_DIR/gpu_tests.log"

# a TERM makes the bench write the rows it has (benchmarks/train_bench.py)
NLQ_BENCH_PROFILE=1 timeout --kill-after=10 310 "$PY" "$BENCH" --shapes gpt3-small-gpu --variants "$BIG" \
    --repeats 1 --results-dir "$OUT_DIR" 2>&1 | tee "$OUT_DIR/bench_gpt3.log"
timeout --kill-after=10 100 "$PY" "$BENCH" --shapes r1-gpu --variants "$SMALL" --repeats 1 \
    --results-dir "$OUT_DIR" 2>&1 | tee "$OUT_DIR/bench_r1.log"
echo "total $(( $(date +%s) - t0 )) s"
