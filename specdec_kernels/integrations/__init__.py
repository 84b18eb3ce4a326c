"""Integrations with other libraries (optional extras; nothing here is imported by
``import specdec_kernels``).

* ``specdec_kernels.integrations.transformers``: our ``tree_attention`` as a Hugging Face
  transformers attention implementation ("specdec_tree") and ``speculative_generate``, a
  drop-in for ``model.generate(assistant_model=..., prompt_lookup_num_tokens=...)`` that
  verifies token trees with our kernels.  Needs ``transformers`` (>= 5).
* ``specdec_kernels.integrations.vllm``: a vLLM plugin (entry point ``vllm.general_plugins``,
  off unless ``SPECDEC_VLLM=1``) through which vLLM v1's speculative decoding verifies with
  ``verify_greedy_flattened`` and ``rejection_sample_flattened``.  Written against vLLM 0.32.0.
"""
