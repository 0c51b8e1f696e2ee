"""deltarl rollout (see the repository README)."""
