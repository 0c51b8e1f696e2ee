"""The delta codecs: how a :class:`~deltarl.weightsync.delta.Delta` becomes bytes.

* :mod:`.formats` — the entry points (``encode_delta``, ``decode_delta``, ``detect_format``,
  ``squash_chain``) over the two formats;
* :mod:`.compact` (+ :mod:`.compact_chunks`, :mod:`.compact_footer`, :mod:`.entropy`,
  :mod:`.context`) — deltarl's lossless compact format (docs/formats.md);
* :mod:`.trl_format` — TRL's sparse safetensors format;
* :mod:`.bits`, :mod:`.kernels` — bit-level helpers and the numba kernels they share.
"""
