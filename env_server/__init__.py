"""deltarl env_server (see the repository README)."""
