#!/usr/bin/env bash
# Issue 36 on one H200: SmolLM2-135M-Instruct on held-out multi-step arithmetic with the calculator environment
# (recipe smollm2_tools) and the same run without the tool (env.args={"tools": false}), same budget, same seed.
# Each run: 20 supervised warm-up steps on the environment's demonstrations, then GRPO until MINUTES of wall time;
# held-out eval (128 problems, greedy + 4 samples) before RL and every 5 steps; tool calls per episode per step.
# From the repository root (the bundle carried along as for the other GPU scripts; the GGUF relayed as before):
#   MILES_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf bash benchmarks/gpu_tools.sh "$OUT" [MINUTES] [RUNS]
# RUNS: "smollm2_tools smollm2_tools_no_tools" (default) or one of them, so each fits one 10-minute device call.
# Writes $OUT/real-model-smollm2_tools{,_no_tools}.gpu.json (+ .metrics.jsonl); benchmarks/results/real-model.gpu.json
# (notebook 10's smollm2_math run) is put back as it was.
set -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_tools.sh OUT_DIR [MINUTES]}
MIN=${2:-4}
mkdir -p "$OUT"
T0=$SECONDS HERE=$PWD
say() { echo "[gpu +$((SECONDS - T0))s] $*" | tee -a "$OUT/progress.txt"; }
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
: "${MILES_SMOLLM2_GGUF:?set MILES_SMOLLM2_GGUF to the SmolLM2-135M-Instruct GGUF file}"
if [ -x .gpubundle/install.sh ] && [ ! -d /tmp/site/ray ]; then
  timeout 30 ./.gpubundle/install.sh > "$OUT/bundle.txt" 2>&1 || say "bundle install failed (rc $?)"
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
cp benchmarks/results/real-model.gpu.json "$OUT/.real-model.keep.json" 2>/dev/null
for run in ${3:-smollm2_tools smollm2_tools_no_tools}; do
  extra=()
  [ $run = smollm2_tools_no_tools ] && extra=(--set 'env.args={"tools": false}' --set run_dir=runs/smollm2_tools_no_tools)
  say "$run: miles bench real-model --recipe smollm2_tools --minutes $MIN ${extra[*]}"
  PYTHONPATH=/tmp/site:$HERE timeout $((MIN * 60 + 240)) $PY -m miles.cli bench real-model --recipe smollm2_tools \
    --minutes "$MIN" "${extra[@]}" > "$OUT/$run.txt" 2> "$OUT/$run.err"
  say "$run: rc $? (124: timed out)"
  tail -3 "$OUT/$run.err"
  cp benchmarks/results/real-model.gpu.json "$OUT/real-model-$run.gpu.json"
  rd=runs/smollm2_tools; [ $run = smollm2_tools_no_tools ] && rd=runs/smollm2_tools_no_tools
  cp "$rd/metrics.jsonl" "$OUT/real-model-$run.gpu.metrics.jsonl"
done
cp "$OUT/.real-model.keep.json" benchmarks/results/real-model.gpu.json 2>/dev/null
say "done"
