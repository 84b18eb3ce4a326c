"""Backends composed of PyTorch's own fused kernels (the "torch" backend of an op)."""
