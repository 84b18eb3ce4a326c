"""The engine: the speculative decoding loop and what it needs, and nothing of any drafter.

* ``loop``: ``SpeculativeDecoder`` (prefill, draft, verify, accept, compact, advance);
* ``state``: ``DecodeState``, ``StepRecord``, ``GenerationResult`` and the step's host/device
  helpers; ``options``: the decoder's option checks; ``prefill``: the prompts' prefill;
  ``verify``: the block a step feeds and the table of verification paths;
  ``draft_checks``: the checks of what a drafter returns; ``graphs``: captured passes;
  ``threads``: the step thread choice;
* ``adaptive``: draft-length policies (how many draft tokens per step) and the tree budget;
  ``calibration``: the run's one calibration of pass cost and acceptance that both read;
* ``typical``: Medusa's typical acceptance (lossy, opt-in);
* ``stats``: ``DecodeStats``.

The engine talks to drafters only through the interface in ``decoding.draft`` (``Drafter``,
``Draft``); every drafter lives in ``decoding.drafters`` and none is imported here.
"""

from specdec_kernels.decoding.engine.loop import DecodeState, GenerationResult, SpeculativeDecoder, StepRecord

__all__ = ["DecodeState", "GenerationResult", "SpeculativeDecoder", "StepRecord"]
