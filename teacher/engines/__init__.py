"""Teacher engines: ``base`` (the interface, numpy only), ``transformers_engine`` (torch) and
``vllm_engine`` (vLLM, imported when built)."""
