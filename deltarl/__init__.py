"""deltarl: disaggregated asynchronous RL with lossless sparse weight deltas.

The code lives in the top-level folders ``services/``, ``trainer/``, ``rollout/`` and
``env_server/`` of the repository; ``deltarl/<folder>`` links to each of them, so they import as
``deltarl.services``, ``deltarl.trainer``, ``deltarl.rollout`` and ``deltarl.env_server``.
"""

__version__ = "0.1.0"
