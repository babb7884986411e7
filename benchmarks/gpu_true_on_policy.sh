#!/usr/bin/env bash
# Issue 33's one device call (at most ~460 s: bundle 20, tests 130, real weights 110, timing 100 + 100):
#   (a) tests/invariant/test_true_on_policy_gpu.py: each Triton op row-invariant, decode attention = full sequence,
#       the CUDA engine (graphs, shared prompt slots) vs the trainer bit for bit for qwen2/llama/qwen3, after a
#       weight sync, and the swaps of one op for torch's;
#   (b) real weights: SmolLM2-135M-Instruct bf16, 64 chat prompts x 8 x 128 tokens, temperature 1, mode off and on
#       ($MILES_SMOLLM2_GGUF, or the first *.gguf carried under .gpubundle/ or shared/);
#   (c) timing off vs on at 135M and 0.5B dimensions, 512 rows x 256 new tokens (rollout and one train step).
# Each part has its own timeout and its own JSON under $OUT, so one part running long loses nothing else. When a
# mode-on mismatch is not 0, the JSON carries the first differing token and the first differing layer and op.
# From the repository root (carry: [".gpubundle"] when the offline bundle is needed):
#   bash benchmarks/gpu_true_on_policy.sh "$OUT"
# Expected: tests.txt all passed; real.json "real": on.max 0.0 (off max ~0.5, mean ~0.04 as in issue 33);
# timing-*.json: on.mismatch.max 0.0, off > 0, rollout_s_on_over_off and train_step_s_on_over_off (target <= 1.5).
# Keep $OUT/real.json as benchmarks/results/true-on-policy.gpu.json (notebooks/11_objectives.ipynb reads it).
# What it does to learning is a second device call (two smollm2_math runs side by side, same seed, 6 minutes):
#   bash benchmarks/gpu_side_by_side.sh "$OUT" 6 off=smollm2_math,seed=0 on=smollm2_math,seed=0,true_on_policy=true
#   then keep $OUT/off.json and $OUT/on.json as benchmarks/results/true-on-policy-smollm2_math-{off,on}.gpu.json
set -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_true_on_policy.sh OUT_DIR}
mkdir -p "$OUT"
T0=$SECONDS
say() { echo "[gpu_true_on_policy +$((SECONDS - T0))s] $*" | tee -a "$OUT/progress.txt"; }
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
PY=${PYTHON:-python3}

if [ -x .gpubundle/install.sh ] && [ ! -d /tmp/site/ray ]; then
  timeout 20 ./.gpubundle/install.sh > "$OUT/bundle.txt" 2>&1 || say "bundle install failed (rc $?): see bundle.txt"
fi
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
git log --oneline -1 2>/dev/null | tee "$OUT/commit.txt"
if [ -z "$MILES_SMOLLM2_GGUF" ]; then
  MILES_SMOLLM2_GGUF=$(find .gpubundle shared -name '*.gguf' 2>/dev/null | head -1)
  export MILES_SMOLLM2_GGUF
fi
say "gguf: ${MILES_SMOLLM2_GGUF:-none found}"

say "(a) tests/invariant/test_true_on_policy_gpu.py"
timeout "${TESTS_S:-130}" $PY -m pytest tests/invariant/test_true_on_policy_gpu.py -o addopts="" -q -p no:cacheprovider \
  -rfEs --durations=0 > "$OUT/tests.txt" 2>&1
say "(a) rc $? (124: timed out)"
grep -E "passed|failed|error|Error|assert|first differing|SKIPPED" "$OUT/tests.txt" | tail -25

bench() {  # bench NAME LIMIT ARGS...: one part of the bench, its JSON and log under $OUT
  local name=$1 limit=$2
  shift 2
  say "($name) miles bench true-on-policy $*"
  timeout "$limit" $PY -m miles.cli bench true-on-policy --json "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
  say "($name) rc $? (124: timed out)"
  tail -4 "$OUT/$name.log"
}
if [ -n "$MILES_SMOLLM2_GGUF" ]; then
  bench real "${REAL_S:-110}" --sizes "" --real "$MILES_SMOLLM2_GGUF"
else
  say "(b) skipped: no SmolLM2 GGUF (set MILES_SMOLLM2_GGUF or carry it under .gpubundle/)"
fi
bench timing-135m "${TIMING_S:-100}" --sizes 135m --real none
bench timing-0.5b "${TIMING_S:-100}" --sizes 0.5b --real none
say "done"
