"""The drafters, one module each (every one a ``decoding.draft.Drafter``):

=================  ==========================================================================
``ngram``          ``NgramDrafter``: prompt lookup over the prompt and the generated text
``model_drafter``  ``DraftModelDrafter`` (a separate small model), ``LayerSkipDrafter`` (the
                   target's first layers), ``ModelDrafter`` (their base)
``medusa``         ``MedusaDrafter`` / ``MedusaHeads``: Medusa and Hydra heads on the target's
                   last hidden state (trained by ``decoding.training.medusa``)
``eagle``          ``EagleDrafter``: an EAGLE-style one-layer draft head with EAGLE-2's
                   dynamic token tree (trained by ``decoding.training.eagle``); re-exports
                   the head's names
``eagle_head``     ``EagleHead``: the head's ``nn.Module`` (EAGLE-3's feature fusion included)
``eagle_format``   ``EagleHeadFile``: the head's file format (``save`` / ``load``)
``eagle_quant``    ``QuantizableHead``: the head's Q8_0 copy (``quantized``)
``lookahead``      ``LookaheadDrafter``: lookahead (Jacobi) decoding's n-gram pool
``multi``          ``MultiDrafter``: builds one of the three below from its flags
``composite``      ``CompositeDrafter``: their base (sub-drafters, statistics, hook forwarding)
``merge``          ``MergeDrafter``: several drafters merged into one token tree
``fallback``       ``FallbackDrafter``: per sequence, the first sub-drafter's draft
``ensemble``       ``EnsembleDrafter``: the sub-drafters' distributions averaged
=================  ==========================================================================
"""
