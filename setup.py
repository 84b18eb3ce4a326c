"""Build of specdec_kernels and its extension specdec_kernels._C.

- CPU sources (csrc/*.cpp except *_cuda.cpp) are always built when torch and a C++ compiler
  are present.
- CUDA sources (csrc/*.cu and csrc/*_cuda.cpp) are added when torch has CUDA, nvcc is found
  (CUDA_HOME) and SPECDEC_SKIP_CUDA_BUILD is not 1.
- TORCH_CUDA_ARCH_LIST (default "8.0;9.0") and MAX_JOBS are respected.
- Without torch, without a compiler, or with SPECDEC_SKIP_EXTENSION=1 the pure-Python
  package still installs; the ops then fall back to the reference with one warning.

Install with `pip install --no-build-isolation -e .` so the build sees the installed torch.
"""
import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg):
    print(f"specdec_kernels setup: {msg}", file=sys.stderr)


def _extensions():
    if os.environ.get("SPECDEC_SKIP_EXTENSION") == "1":
        _log("SPECDEC_SKIP_EXTENSION=1: no extension built")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        _log("torch is not importable at build time: pure-Python install (use --no-build-isolation)")
        return [], {}

    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cpu_sources = [s for s in cpp if not s.endswith("_cuda.cpp")]
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "*.cu"))) + [s for s in cpp if s.endswith("_cuda.cpp")]
    with_cuda = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("SPECDEC_SKIP_CUDA_BUILD") != "1"
        and bool(cuda_sources)
    )
    if not with_cuda:
        _log(
            "building CPU sources only ("
            + ("SPECDEC_SKIP_CUDA_BUILD=1" if os.environ.get("SPECDEC_SKIP_CUDA_BUILD") == "1"
               else "torch has no CUDA" if torch.version.cuda is None else "nvcc not found")
            + ")"
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    # OpenMP in both builds: at::parallel_for in the CPU kernels is serial without it.
    cxx = ["-O3", "-std=c++17", "-fopenmp"]
    if with_cuda:
        ext = CUDAExtension(
            "specdec_kernels._C",
            cpu_sources + cuda_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("SPECDEC_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension(
            "specdec_kernels._C",
            cpu_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )

    class OptionalBuildExt(BuildExtension):
        """Build the extension, but keep the install going (with a warning) if it fails."""

        def run(self):
            try:
                super().run()
            except Exception as e:  # noqa: BLE001  (no compiler, broken toolchain, ...)
                _log(f"WARNING: the extension failed to build ({e}); the ops will use the reference")

    return [ext], {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    packages=find_packages(include=["specdec_kernels", "specdec_kernels.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
