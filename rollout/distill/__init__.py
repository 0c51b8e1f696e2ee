"""Distillation targets a finished group carries: the teacher's logprobs (``teaching.py``) and hinted turns (``hints.py``), gathered by ``group_targets.py``."""
