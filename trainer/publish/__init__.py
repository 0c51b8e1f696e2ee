"""Publication: every optimizer step becomes a version in the bucket (``weights.py``), per rank under FSDP2 (``sharded.py``, ``sharded_fp8.py``)."""
