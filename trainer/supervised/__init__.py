"""Supervised warm start: ``deltarl sft`` (``sft.py``)."""
