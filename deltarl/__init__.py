"""deltarl: disaggregated asynchronous RL with lossless sparse weight deltas.

The code lives in the top-level folders ``services/``, ``trainer/``, ``rollout/``,
``env_server/`` and ``teacher/`` of the repository; setup.py's package map installs each as a
subpackage (``deltarl.services``, ``deltarl.trainer``, ...), without links.
"""

__version__ = "0.1.0"
