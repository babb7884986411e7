#!/usr/bin/env bash
# Issue 23 (build 5), one device call on one H200: the Megatron trainer (trainer.backend=megatron) with the embedded
# engine under the torch trainer's handoff plan (h200_100m shrunk, 3 RL steps, in one process: see
# benchmarks/megatron_embedded.py), then the torch trainer on the same config for comparison. Per step: reward and
# time split; at the end the ledger's device peak and the allocator's against the planner's prediction. From the
# tree's root, with the offline bundle carried (.gpubundle: Ray, megatron-core and miles' dependencies):
#   bash benchmarks/gpu_megatron_embedded.sh "$OUT"
# Writes $OUT/megatron_embedded.json, $OUT/torch_embedded.json and their logs. About 35 s of GPU work; each part has
# its own timeout (bundle install 60 s if not installed yet, megatron 45 s, torch 25 s).
set -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_megatron_embedded.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
if ! python3 -c "import megatron.core, ray" 2>/dev/null; then
  echo "installing the offline bundle into /tmp/site"
  timeout 60 ./.gpubundle/install.sh || echo "bundle install failed or timed out"
fi
for backend in megatron torch; do
  limit=$([ "$backend" = megatron ] && echo 45 || echo 25)
  echo "== $backend trainer + embedded engine (timeout ${limit}s)"
  timeout "$limit" python3 benchmarks/megatron_embedded.py --backend "$backend" --steps 3 \
    --out "$OUT/${backend}_embedded.json" 2>&1 | tee "$OUT/${backend}_embedded.log" | grep -v '^\s*$' | tail -25
  echo "rc=$? ($backend)"
done
