"""deltarl trainer (docs/trainer.md), by concern: ``learn/`` (batches, losses, the optimizer
step, data parallelism), ``publish/`` (versions to the bucket), ``checkpoint/``, ``supervised/``
(``deltarl sft``); the loop (``loop.py``, ``replica.py`` for ranks 1..N-1, ``leases.py``,
``screen.py``), its metrics and the command (``cli.py``, ``settings.py``). Each imports only those
before it (tests/unit/test_layering.py)."""
