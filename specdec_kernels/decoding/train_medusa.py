"""Moved to ``specdec_kernels.decoding.training.medusa``; this name stays so that the command
recorded in the shipped heads (``python -m specdec_kernels.decoding.train_medusa``) still runs."""
import sys
import warnings

from specdec_kernels.decoding.training import medusa as _moved

if __name__ == "__main__":
    sys.exit(_moved.main())
warnings.warn(f"{__name__} moved to {_moved.__name__}", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
