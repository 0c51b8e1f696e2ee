"""One run config for a whole run (config.py), the service settings derived from it (derive.py),
and ``deltarl run exp.toml`` (cli.py), which starts the local system from it."""
