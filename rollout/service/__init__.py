"""The worker service: its lifecycle, heartbeats, weight proofs, admission and submission (``worker.py``), and its ``/health`` and ``/metrics`` (``http.py``, ``metrics.py``)."""
