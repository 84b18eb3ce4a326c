"""What the tests that run the CUDA kernel's own code on the host share (test_kernels.py,
test_paged.py): the ctypes mirrors of csrc/compact_kv_cache.cuh's structs and the nvcc locator."""

import ctypes
import os
import shutil


class KVSlice(ctypes.Structure):  # SpecdecKVSlice in csrc/compact_kv_cache.cuh
    _fields_ = [
        ("base", ctypes.c_void_p),
        ("stride_b", ctypes.c_int64),
        ("stride_h", ctypes.c_int64),
        ("stride_s", ctypes.c_int64),
    ]


class LaunchArgs(ctypes.Structure):  # SpecdecCompactKVArgs in csrc/compact_kv_cache.cuh
    _fields_ = [
        (
            name,
            ctypes.c_void_p
            if name in ("table", "base", "cache_seqlens", "accepted_indices", "num_accepted")
            else ctypes.c_int
            if name.endswith("_int64")
            else ctypes.c_int64,
        )
        for name in (
            "table",
            "base",
            "inner",
            "stride_outer",
            "stride_inner",
            "stride_b",
            "stride_h",
            "stride_s",
            "num_caches",
            "batch",
            "heads",
            "capacity",
            "row_bytes",
            "alignment",
            "cache_seqlens",
            "seqlens_stride",
            "seqlens_int64",
            "accepted_indices",
            "indices_stride_b",
            "indices_stride_m",
            "indices_int64",
            "max_accepted",
            "num_accepted",
            "counts_stride",
            "counts_int64",
        )
    ]


def find_nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found = shutil.which("nvcc") or os.path.join(home, "bin", "nvcc")
    return found if os.path.exists(found) else None
