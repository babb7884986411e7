#!/usr/bin/env bash
# One device call for issue 21: the engine's gpu tests, `miles bench rollout` with a profile, and the RL step
# (recipe h200_100m, 256 new tokens) with this tree's engine and, when $1 names one, with an older tree's (the
# 18:54Z "before" used the tree at 81b84ee: `git archive 81b84ee | tar x -C .wt-before`). From this tree's root:
#   bash benchmarks/rollout_gpu_run.sh "" "$OUT"          # or: bash benchmarks/rollout_gpu_run.sh ../.wt-before "$OUT"
set -o pipefail
MAIN=$1; OUT=${2:-/tmp/out}; HERE=$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
PYTHONPATH=/tmp/site:$HERE timeout 120 python3 -m pytest tests/rollout/test_engine_gpu.py -q -x 2>&1 | tail -25 | tee "$OUT/tests.txt"
PYTHONPATH=/tmp/site:$HERE timeout 300 python3 -m miles.cli bench rollout --json --profile "$OUT/profile.txt" \
  ${BENCH_ARGS:-} 2>&1 | grep -v '^ \|^{\|^}' | tee "$OUT/bench.txt"
cp benchmarks/results/rollout.gpu.json "$OUT/" 2>/dev/null
RL="--recipe h200_100m --set num_steps=3 --set rollout.max_new_tokens=256 --set rollout.max_seq_len=320
    --set model.max_position_embeddings=512 --set trainer.warmup_sft_steps=0"
for side in after before; do
  [ "$side" = before ] && [ -z "$MAIN" ] && break
  [ "$side" = before ] && cd "$MAIN" || cd "$HERE"
  PYTHONPATH=/tmp/site:$PWD timeout ${RL_TIMEOUT:-80} python3 -m miles.cli train $RL --set run_dir=/tmp/rl_$side \
    > "$OUT/rl_$side.log" 2>&1
  python3 - "$side" <<'PY' | tee -a "$OUT/rl.txt"
import json, sys
side = sys.argv[1]
try:
    rows = [json.loads(l) for l in open(f"/tmp/rl_{side}/metrics.jsonl")]
except OSError as e:
    print(side, "no metrics:", e); raise SystemExit
for r in rows:
    g, s = r.get("time/generate", 0), r.get("time/step")
    if not s:
        continue
    print(f"{side} step {r['step']}: step {s:.2f}s generate {g:.2f}s ({100*g/s:.0f}%) tokens {r.get('total_tokens')}")
PY
done
