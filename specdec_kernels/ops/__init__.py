"""The public ops: argument checks, backend dispatch and (per op module) the fast kernels."""
