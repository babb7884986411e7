// One sentence per metric, shown when the pointer rests on a card's title (and read by the browser tests).
// Exact keys first, then prefixes (mem/, moved/, sync/, time/); a key with neither gets no tooltip.

const EXACT = {
  reward: "mean reward of this step's samples (0..1 on the generated tasks)",
  reward_std: "standard deviation of the rewards over this step's samples",
  exact: "fraction of samples with reward 1 (the task solved exactly)",
  loss: "the policy loss the optimizer minimised this step (pg_loss plus the KL term when kl_coef > 0)",
  pg_loss: "policy-gradient loss: minus the clipped ratio x advantage, averaged over response tokens",
  clip_frac: "fraction of response tokens whose probability ratio was clipped (PPO / GRPO clip range)",
  kl: "KL divergence of the policy from the reference model, per response token",
  entropy: "mean entropy of the policy's next-token distribution over response tokens (nats)",
  grad_norm: "global L2 norm of the gradients before clipping",
  response_len: "mean number of generated tokens per sample",
  rollout_tokens: "generated (response) tokens this step",
  total_tokens: "prompt + response tokens this step",
  tokens_per_s: "prompt + response tokens per second of the whole RL step",
  samples_per_s: "samples per second of the whole RL step",
  train_time: "seconds the trainer spent in log-probs, loss, backward and the optimizer step",
  train_rollout_logprob_abs_diff: "mean |train log-prob - rollout log-prob| per response token: the train/rollout mismatch",
  train_rollout_logprob_max_abs_diff: "largest |train log-prob - rollout log-prob| over the step's response tokens: exactly 0 with true_on_policy",
  weight_version: "the weight version the engines served after this step's sync",
  "sft/sft_loss": "cross-entropy of the supervised warm-up step (before the RL steps)",
  "sft/grad_norm": "gradient norm of the supervised warm-up step",
};
const PREFIX = {
  "mem/": (k) => (k === "mem/rss_max" ? "largest resident set size of the run's processes this step (what the OS sees)"
    : `peak bytes held in the ${k.slice(4).replace("_peak", "")} pool during this step (the ledger, in time order)`),
  "moved/": (k) => `bytes moved by the handoff step ${k.slice(6)} this RL step`,
  "sync/": (k) => ({
    "sync/bytes": "bytes the weight sync sent to the engines", "sync/seconds": "wall time of the weight sync",
    "sync/gbps": "weight-sync throughput (GB/s, 10^9 bytes)", "sync/buckets": "buckets the weights were packed into",
    "sync/engine_wait_s": "sync seconds spent waiting for the engines to load a bucket",
    "sync/pack_s": "sync seconds spent packing weights into staging buckets",
    "sync/begin_s": "sync seconds spent pausing the engines and opening the update",
    "sync/commit_s": "sync seconds spent setting the version and resuming generation",
  })[k] ?? "a phase of the weight sync (seconds or bytes)",
  "reward/": (k) => ({
    "reward/timeouts": "reward calls past data.reward_timeout_s this step (killed; scored data.reward_on_error)",
    "reward/errors": "reward calls that raised or returned a non-finite number this step (scored data.reward_on_error)",
  })[k] ?? "a figure of this step's reward scoring",
  "time/": (k) => ({
    "time/step": "wall time of the whole RL step", "time/generate": "seconds the engines spent generating",
    "time/rollout": "seconds of the rollout: generation, rewards, advantages, batches",
    "time/reward": "seconds spent scoring this step's samples (reward workers included)",
  })[k] ?? `seconds spent in ${k.slice(5)}`,
};

export function describe(key) {
  if (key in EXACT) return EXACT[key];
  for (const [prefix, f] of Object.entries(PREFIX)) if (key.startsWith(prefix)) return f(key);
  return "";
}
