#!/usr/bin/env bash
# One short GPU loan's share of the study's GPU rungs: continue the committed study for at most
# NLQ_GPU_S seconds, stop it (SIGTERM: running runs checkpoint and stop, every finished run is
# exported), and pack the export into one file, so a loan of minutes adds its finished runs
# and loses none.
#
#   OUT=DIR NLQ_GPU_S=420 bash scripts/gpu_study.sh [RUNGS]      # RUNGS default R1,R2
#
# Needs the rungs' data (data/all-bpe512: `nlq prepare --source embedded:all --tokenizer
# bpe:512`, or carried). Environment: NLQ_GPU_S (seconds for the bench and the study together,
# default 420; the command that runs this script needs ~60 s more for the stop and the pack), NLQ_JOBS
# (default auto), NLQ_STUDY (the working study, default out/study), NLQ_FROM (the committed
# study it starts from when NLQ_STUDY does not exist yet, default results/study; its finished
# runs are not trained again), NLQ_STUDY_ARGS (more `nlq study` arguments, e.g. --ladder),
# NLQ_STACK_BENCH=STEPS (first, at most 180 s: benchmarks/stack_bench.py on the first rung's
# shape, stacks of 4 and 8 against a lone run, its JSON and log into DIR; a tree without .git
# needs NLQ_BENCH_COMMIT=<the commit it is>).
# Writes DIR/study.tgz (the exported study: every rung's finished runs and reports, no
# checkpoints) and DIR/study.log (the end of the study's output). Back on the machine that
# commits: `tar -xzf study.tgz -C /tmp && cp -a /tmp/study/. results/study/`.
set -uo pipefail
cd "$(dirname "$0")/.."
RUNGS=${1:-R1,R2}
OUT_DIR=${OUT:?set OUT to the folder that receives study.tgz and study.log}
LIMIT=${NLQ_GPU_S:-420}
STUDY=${NLQ_STUDY:-out/study}
FROM=${NLQ_FROM:-results/study}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT_DIR"
if [ ! -d "$STUDY" ] && [ -d "$FROM" ]; then
    mkdir -p "$(dirname "$STUDY")" && cp -r "$FROM" "$STUDY"
fi
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv
t0=$(date +%s)
if [ -n "${NLQ_STACK_BENCH:-}" ]; then
    # a TERM stops its run at a step boundary and the bench writes its complete repeats
    timeout --signal=TERM --kill-after=10 180 "$PY" benchmarks/stack_bench.py \
        --rung "${RUNGS%%,*}" --stacks 4,8 --steps "$NLQ_STACK_BENCH" --repeats 1 \
        --results-dir "$OUT_DIR" > "$OUT_DIR/stack_bench.log" 2>&1
    grep -a -v "^step " "$OUT_DIR/stack_bench.log" | tail -n 6
fi
LEFT=$(( LIMIT - ($(date +%s) - t0) ))  # the study gets what the bench left of NLQ_GPU_S
[ "$LEFT" -lt 10 ] && LEFT=10
# shellcheck disable=SC2086  # NLQ_STUDY_ARGS is a list of arguments
timeout --signal=TERM --kill-after=60 "$LEFT" "$PY" -m nlq study --rungs "$RUNGS" \
    --out "$STUDY" --jobs "${NLQ_JOBS:-auto}" --export "$OUT_DIR/study" ${NLQ_STUDY_ARGS:-} \
    > "$OUT_DIR/study.full.log" 2>&1
rc=$?
# the progress bars make the log long: its end says how the study stopped
tail -c 2000000 "$OUT_DIR/study.full.log" > "$OUT_DIR/study.log" && rm "$OUT_DIR/study.full.log"
grep -a -v "runs: " "$OUT_DIR/study.log" | tail -n 15
if [ ! -d "$OUT_DIR/study" ]; then
    echo "gpu_study: nothing was exported (rc $rc): see $OUT_DIR/study.log" >&2
    exit 1
fi
tar -czf "$OUT_DIR/study.tgz" -C "$OUT_DIR" study && rm -rf "$OUT_DIR/study"
echo "gpu_study: rc $rc; $(tar -tzf "$OUT_DIR/study.tgz" | grep -c '/summary.json$') finished runs in \
$OUT_DIR/study.tgz"
[ "$rc" -eq 124 ] && echo "gpu_study: stopped at NLQ_GPU_S=$LIMIT s: run it again to continue"
[ "$rc" -eq 0 ] || [ "$rc" -eq 124 ]
