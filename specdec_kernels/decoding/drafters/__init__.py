"""The drafters, one module each (every one a ``decoding.draft.Drafter``):

=================  ==========================================================================
``ngram``          ``NgramDrafter``: prompt lookup over the prompt and the generated text
``model_drafter``  ``DraftModelDrafter`` (a separate small model), ``LayerSkipDrafter`` (the
                   target's first layers), ``ModelDrafter`` (their base)
``medusa``         ``MedusaDrafter`` / ``MedusaHeads``: Medusa and Hydra heads on the target's
                   last hidden state (trained by ``decoding.training.medusa``)
``eagle``          ``EagleDrafter`` / ``EagleHead``: an EAGLE-style one-layer draft head with
                   EAGLE-2's dynamic token tree (trained by ``decoding.training.eagle``)
``lookahead``      ``LookaheadDrafter``: lookahead (Jacobi) decoding's n-gram pool
``multi``          ``MultiDrafter``: several drafters merged into one token tree, or their
                   distributions averaged (ensemble)
=================  ==========================================================================
"""
