"""The teacher service (``deltarl teacher``): a teacher model's per-token logprobs for given token
sequences, for on-policy distillation; see docs/teacher.md.

* ``wire``: the binary and JSON formats of ``POST /v1/logprobs`` (numpy + pydantic only);
  ``limits``: their bounds (standard library)
* ``client``: :class:`~deltarl.teacher.client.TeacherClient` (httpx, binary, retries)
* ``engines``: ``transformers`` (default) and ``vllm``; ``batcher``: requests -> engine batches
* ``app`` (FastAPI factory), ``metrics``, ``settings`` (``DELTARL_TEACHER_*``), ``cli``

Nothing is imported here, so ``import deltarl.teacher.client`` loads no server code.
"""
