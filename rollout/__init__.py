"""deltarl rollout, the worker (docs/rollout.md), by concern: ``engines/`` (transformers, vLLM),
``sync/`` (weight versions applied in place), ``episodes/`` (games against the env server),
``distill/`` (teacher and hint targets), ``service/`` (the worker process, its HTTP), with its
settings (``settings.py``) and command (``cli.py``). Each imports only those before it
(tests/unit/test_layering.py)."""
