"""Speculative decoding on a real model: a Llama-family forward over a static KV cache,
drafters (n-gram / prompt lookup, layer-skip self-drafting, a separate draft model, Medusa
and EAGLE heads with their loaders, lookahead, several merged: every shipped drafter imports
from here), chain and tree verification, statistics.  The CLI is ``python -m specdec_kernels.generate``.

Quick start::

    from specdec_kernels.decoding import NgramDrafter, SpeculativeDecoder, load_smollm2

    model, tok = load_smollm2()                      # SmolLM2-135M-Instruct, float32
    ids = tok.apply_chat_template([{"role": "user", "content": "..."}],
                                  add_generation_prompt=True, return_dict=False)
    decoder = SpeculativeDecoder(model, NgramDrafter(), stop_token_ids=[tok.eos_token_id])
    result = decoder.generate([ids], max_new_tokens=128, num_draft_tokens=6)
    print(tok.decode(result.tokens[0]))
    print(result.stats.summary())
"""

from specdec_kernels.decoding.draft import (
    Draft,
    Drafter,
    DraftRequest,
    DraftRun,
    NoDrafter,
    SamplingParams,
    StepResult,
    TargetFeatures,
)
from specdec_kernels.decoding.drafters.composite import CompositeDrafter
from specdec_kernels.decoding.drafters.eagle import EagleDrafter, EagleHead, load_eagle_head
from specdec_kernels.decoding.drafters.eagle_format import EagleHeadFile
from specdec_kernels.decoding.drafters.eagle_quant import QuantizableHead
from specdec_kernels.decoding.drafters.ensemble import EnsembleDrafter
from specdec_kernels.decoding.drafters.fallback import FallbackDrafter
from specdec_kernels.decoding.drafters.lookahead import LookaheadDrafter
from specdec_kernels.decoding.drafters.medusa import MedusaDrafter, MedusaHeads, load_medusa_heads
from specdec_kernels.decoding.drafters.merge import MergeDrafter
from specdec_kernels.decoding.drafters.model_drafter import DraftModelDrafter, LayerSkipDrafter, ModelDrafter
from specdec_kernels.decoding.drafters.multi import MultiDrafter
from specdec_kernels.decoding.drafters.ngram import NgramDrafter, ngram_continuations
from specdec_kernels.decoding.engine.adaptive import (
    CostModelPolicy,
    DraftLengthPolicy,
    FixedPolicy,
    HeuristicPolicy,
    default_policy,
)
from specdec_kernels.decoding.engine.loop import DecodeState, GenerationResult, SpeculativeDecoder
from specdec_kernels.decoding.engine.stats import DecodeStats
from specdec_kernels.decoding.engine.typical import typical_acceptance
from specdec_kernels.decoding.loading import have_smollm2, load_hf_smollm2, load_smollm2
from specdec_kernels.decoding.model import ModelArgs, Transformer

__all__ = [
    "CompositeDrafter",
    "CostModelPolicy",
    "DraftLengthPolicy",
    "EagleDrafter",
    "EagleHead",
    "EagleHeadFile",
    "EnsembleDrafter",
    "FallbackDrafter",
    "LookaheadDrafter",
    "FixedPolicy",
    "HeuristicPolicy",
    "MedusaDrafter",
    "MedusaHeads",
    "MergeDrafter",
    "MultiDrafter",
    "QuantizableHead",
    "default_policy",
    "load_eagle_head",
    "load_medusa_heads",
    "typical_acceptance",
    "DecodeState",
    "DecodeStats",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "DraftRequest",
    "DraftRun",
    "StepResult",
    "TargetFeatures",
    "GenerationResult",
    "LayerSkipDrafter",
    "ModelArgs",
    "ModelDrafter",
    "NgramDrafter",
    "NoDrafter",
    "SamplingParams",
    "SpeculativeDecoder",
    "Transformer",
    "have_smollm2",
    "load_hf_smollm2",
    "load_smollm2",
    "ngram_continuations",
]
