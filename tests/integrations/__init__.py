"""The integrations: transformers' attention interface, the vLLM plugin, SGLang's tree layout."""
