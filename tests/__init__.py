"""The tests mirror the package: ``ops/<op>/`` for each public op (``ops/`` itself for the checks
that cover every op at once); shared helpers in ``utils.py``."""
