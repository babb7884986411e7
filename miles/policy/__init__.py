"""The policy's math: per-token log-probs and entropy in model precision, advantages and losses."""
