#!/usr/bin/env bash
# Issue 21's one device call (at most 170 s: bundle 20, tests 45, bench 55, RL 50; typically ~140):
#   (a) the engine's GPU tests; (b) `miles bench rollout` at 0.5B dimensions, 64 and 512 rows x 256 and 1024
#   new tokens, no HF generate (the 28x over HF stands from the 20:19Z run), with a torch.profiler summary of a
#   512-row run; (c) the RL step (recipe h200_100m, 3 steps, 256 new tokens): step and generate seconds.
# From the repository root, with the offline bundle carried along (carry: [".gpubundle"]):
#   bash benchmarks/gpu_issue21.sh "$OUT"
# Limits can be changed: TESTS_S, BENCH_S, RL_S (seconds). Everything it writes goes under $OUT.
set -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_issue21.sh OUT_DIR}
mkdir -p "$OUT"
T0=$SECONDS
say() { echo "[gpu_issue21 +$((SECONDS - T0))s] $*" | tee -a "$OUT/progress.txt"; }
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
PY=${PYTHON:-python3}

say "bundle: Ray, megatron-core and miles' dependencies into /tmp/site"
if [ -x .gpubundle/install.sh ] && [ ! -d /tmp/site/ray ]; then
  timeout 20 ./.gpubundle/install.sh > "$OUT/bundle.txt" 2>&1 || say "bundle install failed (rc $?): see bundle.txt"
fi
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"

say "(a) tests/rollout/test_engine_gpu.py"
# the project's addopts name plugins (nbval, pytest-timeout) the device may lack: this part has its own timeout
timeout "${TESTS_S:-45}" $PY -m pytest tests/rollout/test_engine_gpu.py -o addopts="" -q -p no:cacheprovider -rfE \
  --durations=0 > "$OUT/tests.txt" 2>&1
say "(a) rc $? (124: timed out)"
grep -E "passed|failed|error|Error|assert" "$OUT/tests.txt" | tail -15

say "(b) miles bench rollout: 0.5b, rows 64,512 x new tokens 256,1024, no HF; profile of 512 rows"
timeout "${BENCH_S:-55}" $PY -m miles.cli bench rollout --json --sizes 0.5b --rows 64,512 --new-tokens 256,1024 \
  --no-hf --profile "$OUT/profile_512rows.txt" --profile-rows 512 > "$OUT/bench.json" 2> "$OUT/bench.err"
rc=$?
say "(b) rc $rc (124: timed out)"
grep -hE "rows=|Error|error" "$OUT/bench.json" "$OUT/bench.err" | tail -8
[ $rc = 0 ] && cp benchmarks/results/rollout.gpu.json "$OUT/rollout.gpu.json"  # the table, only when this run wrote it

say "(c) miles train --recipe h200_100m, 3 steps at 256 new tokens"
rm -rf /tmp/rl_issue21
timeout "${RL_S:-50}" $PY -m miles.cli train --recipe h200_100m --set num_steps=3 --set rollout.max_new_tokens=256 \
  --set rollout.max_seq_len=320 --set model.max_position_embeddings=512 --set trainer.warmup_sft_steps=0 \
  --set run_dir=/tmp/rl_issue21 > "$OUT/rl.log" 2>&1
say "(c) rc $? (124: timed out)"
cp /tmp/rl_issue21/metrics.jsonl "$OUT/rl_metrics.jsonl" 2>/dev/null
$PY - /tmp/rl_issue21/metrics.jsonl <<'PY' | tee "$OUT/rl.txt"
import json, sys

try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError as e:
    raise SystemExit(f"no metrics: {e}")
for r in rows:
    g, s = r.get("time/generate", 0.0), r.get("time/step")
    if s:
        print(f"step {r['step']}: step {s:.2f}s generate {g:.2f}s ({100 * g / s:.0f}%) tokens {r.get('total_tokens')}")
PY
say "done"
