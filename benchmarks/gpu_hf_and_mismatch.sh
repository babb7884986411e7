#!/usr/bin/env bash
# One device call (issues 21 and 22), at most ~420 s:
#   (a) `miles bench rollout` at its defaults (0.1B and 0.5B, 64 and 512 rows, 256 and 1024 new tokens) WITH HF
#       generate on the same weights (up to 256 new tokens), so engine / HF / floor come from one run;
#   (b) the quickstart in bf16 on the GPU, 20 RL steps, with this tree's engine and with the tree before the
#       engine work (81b84ee, the mismatch metric already fixed there): train_rollout_logprob_abs_diff and KL.
# From the repository root, the bundle and the old tree carried along (carry: [".gpubundle", ".wt-before"]):
#   bash benchmarks/gpu_hf_and_mismatch.sh "$OUT"         (make .wt-before: git archive 81b84ee | tar x -C .wt-before)
set -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_hf_and_mismatch.sh OUT_DIR}
mkdir -p "$OUT"
T0=$SECONDS HERE=$PWD
say() { echo "[gpu +$((SECONDS - T0))s] $*" | tee -a "$OUT/progress.txt"; }
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -x .gpubundle/install.sh ] && [ ! -d /tmp/site/ray ]; then
  timeout 30 ./.gpubundle/install.sh > "$OUT/bundle.txt" 2>&1 || say "bundle install failed (rc $?)"
fi
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"

say "(a) miles bench rollout (defaults, with HF generate)"
PYTHONPATH=/tmp/site:$HERE timeout "${BENCH_S:-300}" $PY -m miles.cli bench rollout --json > "$OUT/bench.json" 2> "$OUT/bench.err"
rc=$?
say "(a) rc $rc (124: timed out)"
tail -5 "$OUT/bench.err"
[ $rc = 0 ] && cp benchmarks/results/rollout.gpu.json "$OUT/rollout.gpu.json"

# today's quickstart spelled out, so the older tree (reverse task, 16 prompts, 40 warm-up steps) runs the same job
QS="--recipe quickstart --set device=cuda --set model.dtype=bfloat16 --set num_steps=20 --set checkpoint_every=0
    --set task.name=sort --set rollout.num_prompts_per_step=32 --set rollout.max_batch_size=256
    --set trainer.warmup_sft_steps=25 --set trainer.entropy_coef=0.03"
for side in after before; do
  dir=$HERE; [ "$side" = before ] && dir=$HERE/.wt-before
  [ -d "$dir/miles" ] || { say "no tree for $side"; continue; }
  say "(b) quickstart bf16, $side the engine work"
  rm -rf "/tmp/qs_$side"
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "${QS_S:-90}" $PY -m miles.cli train $QS --no-progress \
    --set run_dir="/tmp/qs_$side" > "$OUT/qs_$side.log" 2>&1)
  say "(b) $side rc $?"
  cp "/tmp/qs_$side/metrics.jsonl" "$OUT/qs_${side}_metrics.jsonl" 2>/dev/null
done
$PY - "$OUT" <<'PY' | tee "$OUT/mismatch.txt"
import json, statistics, sys
for side in ("before", "after"):
    try:
        rows = [json.loads(line) for line in open(f"{sys.argv[1]}/qs_{side}_metrics.jsonl")]
    except OSError as e:
        print(side, "no metrics:", e)
        continue
    rl = [r for r in rows if "train_rollout_logprob_abs_diff" in r]
    d = [r["train_rollout_logprob_abs_diff"] for r in rl]
    k = [r.get("train_rollout_kl", float("nan")) for r in rl]
    rw = [r["reward"] for r in rl]
    print(f"{side}: {len(rl)} RL steps, abs diff median {statistics.median(d):.3e} max {max(d):.3e}, "
          f"kl median {statistics.median(k):.3e}, reward {sum(rw[:3]) / 3:.3f} -> {sum(rw[-3:]) / 3:.3f}")
PY
say "done"
