"""One run config for a whole run (config.py), the service settings derived from it (derive.py),
and ``deltarl run exp.toml`` (cli.py), which starts the local system from it; the same system
from command-line arguments for experiments and benchmarks on GPUs (experiment.py, run by
bench/wordle_gpu_run.py) and what a finished run did (summary.py)."""
