"""Checkpoints: what the trainer needs to continue (``store.py``), per rank under FSDP2 (``sharded.py``), written and read as hashed files (``files.py``)."""
