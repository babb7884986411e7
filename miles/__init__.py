"""miles: a compact RL post-training engine for language models (trainer, rollout engine, weight sync,
GPU memory offload, agent rollouts, a dashboard), orchestrated by Ray and driven from notebooks."""

__version__ = "0.1.0"
