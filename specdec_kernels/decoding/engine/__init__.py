"""The engine: the speculative decoding loop and what it needs, and nothing of any drafter.

* ``loop``: ``SpeculativeDecoder`` (prefill, draft, verify, accept, compact), ``DecodeState``,
  ``GenerationResult``;
* ``adaptive``: draft-length policies (how many draft tokens per step);
* ``typical``: Medusa's typical acceptance (lossy, opt-in);
* ``stats``: ``DecodeStats``.

The engine talks to drafters only through the interface in ``decoding.draft`` (``Drafter``,
``Draft``); every drafter lives in ``decoding.drafters`` and none is imported here.
"""

from specdec_kernels.decoding.engine.loop import DecodeState, GenerationResult, SpeculativeDecoder, StepRecord

__all__ = ["DecodeState", "GenerationResult", "SpeculativeDecoder", "StepRecord"]
