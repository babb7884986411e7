"""Weight sync: getting the trainer's weights into every rollout engine after a step, with a version."""
