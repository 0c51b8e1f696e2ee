"""deltarl trainer (see the repository README)."""
