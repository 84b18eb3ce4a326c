"""The tests mirror the package: ``ops/<op>/`` for each public op (``ops/`` itself for the checks
that cover every op at once), ``engine/`` for the decoding engine, ``integrations/`` for
transformers, vLLM and SGLang, ``bench/`` for the benchmark commands, ``test_tree.py`` for the
token-tree helpers; shared helpers and thresholds in ``utils.py``."""
