"""deltarl: disaggregated asynchronous RL with lossless sparse weight deltas.

The code lives in the top-level folders of the repository: ``weightsync/`` (the delta codec,
publication, catch-up planning, proofs) and ``buckets/`` (object-store backends), the library every
process uses; ``services/`` (the coordinator and the services' shared scaffolding),
``env_server/``, ``teacher/``, ``rollout/`` and ``trainer/``; and ``deltarl/`` itself, the
``deltarl`` command and its tools (demo, run, eval, Spaces deploy). setup.py's package map
installs each folder as a subpackage (``deltarl.weightsync``, ``deltarl.trainer``, ...), without
links; ``tests/unit/test_layering.py`` holds which may import which.
"""

__version__ = "0.1.0"
