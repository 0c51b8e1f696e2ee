"""Evaluations of a model directory on an environment's own rules (``deltarl eval``)."""
