"""What the tests that run the CUDA kernel's own code on the host share (test_kernels.py,
test_paged.py): the ctypes mirrors of csrc/compact_kv_cache.cuh's structs, the nvcc locator
and the build of the kernel source as a host library (the ``emulator`` fixture in conftest.py)."""

import ctypes
import os
import shutil
import subprocess

import torch

from tests.utils import ROOT


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


class PagedLaunchArgs(ctypes.Structure):  # SpecdecPagedCompactKVArgs in csrc/compact_kv_cache.cuh
    _fields_ = [
        ("kv", LaunchArgs),
        ("block_table", ctypes.c_void_p),
        ("block_table_stride_b", ctypes.c_int64),
        ("block_table_stride_m", ctypes.c_int64),
        ("block_table_int64", ctypes.c_int),
        ("max_blocks_per_seq", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
    ]


def describe_caches(lib: ctypes.CDLL, a: LaunchArgs, slices: list, row_bytes: int):
    """The kernel's own host code describes the cache slices (tuples of KVSlice's fields) into
    ``a``: form 1 is one base and strides, 0 a table of per-cache bases (its address then set
    in ``a``).  Returns (form, the ctypes table, which must outlive the launch)."""
    table = (KVSlice * len(slices))(*[KVSlice(*e) for e in slices])
    form = lib.specdec_compact_kv_cache_describe(ctypes.byref(a), table, len(slices), row_bytes)
    assert form in (0, 1)
    if form == 0:
        a.table = ctypes.addressof(table)
    return form, table


def set_index_args(a: LaunchArgs, seqlens: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor) -> None:
    """The launch arguments of the index tensors: their data, strides and widths (int32/int64)."""
    a.cache_seqlens, a.seqlens_stride, a.seqlens_int64 = (
        seqlens.data_ptr(),
        seqlens.stride(0),
        seqlens.dtype == torch.int64,
    )
    a.accepted_indices, a.indices_int64 = indices.data_ptr(), indices.dtype == torch.int64
    a.indices_stride_b, a.indices_stride_m = indices.stride()
    a.max_accepted = indices.shape[1]
    a.num_accepted, a.counts_stride, a.counts_int64 = counts.data_ptr(), counts.stride(0), counts.dtype == torch.int64


def build_emulator(nvcc: str, out: str) -> ctypes.CDLL:
    """csrc/compact_kv_cache_kernel.cu compiled by nvcc as a host library (the kernel's own
    code, SPECDEC_COMPACT_KV_HOST_EMULATION), its entry points typed."""
    subprocess.run(
        [
            nvcc,
            "-x",
            "cu",
            "-std=c++17",
            "-O1",
            "-shared",
            "-Xcompiler",
            "-fPIC",
            "-arch=sm_80",
            "-DSPECDEC_COMPACT_KV_HOST_EMULATION",
            "-I",
            os.path.join(ROOT, "csrc"),
            os.path.join(ROOT, "csrc", "compact_kv_cache_kernel.cu"),
            "-o",
            out,
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    lib = ctypes.CDLL(out)
    lib.specdec_compact_kv_cache_describe.restype = ctypes.c_int
    lib.specdec_compact_kv_cache_describe.argtypes = [
        ctypes.POINTER(LaunchArgs),
        ctypes.POINTER(KVSlice),
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    lib.specdec_compact_kv_cache_emulate.restype = ctypes.c_int
    lib.specdec_compact_kv_cache_emulate.argtypes = [ctypes.POINTER(LaunchArgs), ctypes.c_int64, ctypes.c_int64]
    lib.specdec_paged_compact_kv_cache_emulate.restype = ctypes.c_int
    lib.specdec_paged_compact_kv_cache_emulate.argtypes = [
        ctypes.POINTER(PagedLaunchArgs),
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    lib.specdec_compact_kv_cache_word_bytes.restype = ctypes.c_int
    lib.specdec_compact_kv_cache_word_bytes.argtypes = [ctypes.POINTER(LaunchArgs)]
    return lib
