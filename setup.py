"""Build of specdec_kernels and its extension specdec_kernels._C.

- CPU sources (csrc/*.cpp except *_cuda.cpp) are always built when torch and a C++ compiler
  are present.
- CUDA sources (csrc/*.cu and csrc/*_cuda.cpp) are added when torch has CUDA, nvcc is found
  (CUDA_HOME) and SPECDEC_SKIP_CUDA_BUILD is not 1.
- TORCH_CUDA_ARCH_LIST (default "8.0;9.0") and MAX_JOBS are respected.
- SPECDEC_SKIP_EXTENSION=1: a pure-Python install on purpose; the ops then fall back to the
  reference with one warning at first use.
- Otherwise the build needs the installed torch: `pip install --no-build-isolation .` (in pip's
  isolated build environment torch is missing, and the build stops with an error saying so,
  instead of silently giving a wheel without the extension).
- A C++/CUDA build error is a warning (the package installs, the ops fall back to the reference
  and say why at first use, from specdec_kernels/_build_info.json), or an error with
  SPECDEC_REQUIRE_NATIVE=1 (CI sets it, so a broken extension fails CI).
- With the extension built, the torch requirement is the torch it was built against
  (``torch==X.Y.*``: the extension's C++ ABI is that torch's).
- The extension carries no debug information: ``-g0`` after Python's own ``-g`` and a stripped
  link (``-s``; the dynamic symbols Python and torch look up stay).  SPECDEC_DEBUG=1 builds it
  with ``-g`` and unstripped, for a debugger.
"""

import collections
import glob
import json
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg):
    print(f"specdec_kernels setup: {msg}", file=sys.stderr)


BUILD_INFO = os.path.join(ROOT, "specdec_kernels", "_build_info.json")
REQUIRE_NATIVE = os.environ.get("SPECDEC_REQUIRE_NATIVE") == "1"
DEBUG = os.environ.get("SPECDEC_DEBUG") == "1"
# appended after Python's CFLAGS (which hold -g) and to the link: no debug sections, no symbol table
DEBUG_CFLAGS = ["-g"] if DEBUG else ["-g0"]
STRIP_LDFLAGS = [] if DEBUG else ["-s"]


def _record(built: bool, reason: str, build_lib: str = None) -> None:
    """What the build did, read by specdec_kernels._native for its first-use warning: in the
    source tree (editable installs) and in the build folder that becomes the wheel."""
    paths = [BUILD_INFO] + ([os.path.join(build_lib, "specdec_kernels", "_build_info.json")] if build_lib else [])
    for path in paths:
        if os.path.isdir(os.path.dirname(path)):
            with open(path, "w") as f:
                json.dump({"extension": built, "reason": reason, "debug": DEBUG}, f)


def _cuda_home() -> None:
    """Set CUDA_HOME where torch would guess wrong.  Without CUDA_HOME or CUDA_PATH, torch takes
    the parent of the folder that holds the ``nvcc`` on PATH.  Where that nvcc is a wrapper
    script (/usr/local/bin/nvcc calling /usr/local/cuda-13.0/bin/nvcc), the guess (/usr/local)
    has no CUDA headers and the build fails on ``cuda_runtime.h``.  Then the toolkit at
    /usr/local/cuda is used, if it has the headers."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    guess = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    fallback = "/usr/local/cuda"
    if not os.path.exists(os.path.join(guess, "include", "cuda_runtime.h")) and os.path.exists(
        os.path.join(fallback, "include", "cuda_runtime.h")
    ):
        _log(f"{nvcc} is not inside a CUDA toolkit: CUDA_HOME={fallback}")
        os.environ["CUDA_HOME"] = fallback


def _extensions():
    if os.environ.get("SPECDEC_SKIP_EXTENSION") == "1":
        _log("SPECDEC_SKIP_EXTENSION=1: no extension built")
        _record(False, "installed with SPECDEC_SKIP_EXTENSION=1")
        return [], {}, None
    _cuda_home()
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        raise SystemExit(
            "specdec_kernels setup: error: torch is not importable in this build environment, so the C++/CUDA "
            "extension cannot be built against your torch. Install with `pip install --no-build-isolation .` "
            "(torch installed first), or set SPECDEC_SKIP_EXTENSION=1 for a pure-Python install (the ops then "
            "run their PyTorch reference)."
        ) from None

    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cpu_sources = [s for s in cpp if not s.endswith("_cuda.cpp")]
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "*.cu"))) + [s for s in cpp if s.endswith("_cuda.cpp")]
    # torch's ninja build names each object after its source's stem (csrc/x.cpp and csrc/x.cu would
    # both be build/.../csrc/x.o, and ninja refuses the whole CUDA build), so stems must be unique.
    stems = collections.Counter(os.path.splitext(os.path.basename(s))[0] for s in sorted(set(cpp + cuda_sources)))
    clashes = sorted(stem for stem, n in stems.items() if n > 1)
    if clashes:
        raise SystemExit(f"specdec_kernels setup: error: csrc/ sources share a name stem {clashes}; rename one")
    with_cuda = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("SPECDEC_SKIP_CUDA_BUILD") != "1"
        and bool(cuda_sources)
    )
    if not with_cuda:
        _log(
            "building CPU sources only ("
            + (
                "SPECDEC_SKIP_CUDA_BUILD=1"
                if os.environ.get("SPECDEC_SKIP_CUDA_BUILD") == "1"
                else "torch has no CUDA"
                if torch.version.cuda is None
                else "nvcc not found"
            )
            + ")"
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    # OpenMP in both builds: at::parallel_for in the CPU kernels is serial without it.
    cxx = ["-O3", "-std=c++17", "-fopenmp"] + DEBUG_CFLAGS
    if with_cuda:
        ext = CUDAExtension(
            "specdec_kernels._C",
            cpu_sources + cuda_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("SPECDEC_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]},
            extra_link_args=["-fopenmp"] + STRIP_LDFLAGS,
        )
    else:
        ext = CppExtension(
            "specdec_kernels._C",
            cpu_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"] + STRIP_LDFLAGS,
        )

    class OptionalBuildExt(BuildExtension):
        """Build the extension; on failure keep the install going with a warning (recorded for
        the first-use warning), or stop with SPECDEC_REQUIRE_NATIVE=1."""

        def run(self):
            try:
                super().run()
            except Exception as e:  # noqa: BLE001  (no compiler, broken toolchain, ...)
                if REQUIRE_NATIVE:
                    raise SystemExit(
                        f"specdec_kernels setup: error: the extension failed to build ({e}) "
                        "and SPECDEC_REQUIRE_NATIVE=1"
                    ) from e
                _log(f"WARNING: the extension failed to build ({e}); the ops will use the reference")
                _record(False, f"the C++/CUDA build failed: {str(e)[:300]}", None if self.inplace else self.build_lib)
                return
            _record(True, f"built against torch {torch.__version__}", None if self.inplace else self.build_lib)

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    torch_requirement = f"torch=={major}.{minor}.*"  # the extension's C++ ABI is this torch's
    return [ext], {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}, torch_requirement


ext_modules, cmdclass, torch_requirement = _extensions()

setup(
    install_requires=["numpy", torch_requirement or "torch>=2.4"],
    packages=find_packages(include=["specdec_kernels", "specdec_kernels.*"]),
    py_modules=["specdec_kernels_vllm"],  # the vLLM entry point (see that module)
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
