"""Training drafters on CPU by self-distillation on the target's own outputs.

* ``data``: the shared pipeline (Spec-Bench prompts, the target's greedy continuations and
  its hidden states, cached on disk);
* ``medusa``: Medusa / Hydra heads, ``python -m specdec_kernels.decoding.training.medusa``;
* ``eagle``: the EAGLE-style draft head, ``python -m specdec_kernels.decoding.training.eagle``.
"""
