"""The rollout-mismatch diagnostics of the log-prob op (``rollout_topk=``): the trainer's
distribution against the rollout engine's top-k, per position (docs/rollout-mismatch.md)."""
