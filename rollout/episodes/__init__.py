"""Episodes: multi-turn games against the env server (``runner.py``), their flat token sequences (``chat_format.py``) and the submission of finished groups (``trajectories.py``)."""
