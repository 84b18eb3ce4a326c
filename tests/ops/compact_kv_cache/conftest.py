import pytest

from tests.ops.compact_kv_cache.host_emulation import build_emulator, find_nvcc


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    """The CUDA kernel source compiled for host emulation (ctypes library), once per session."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: cannot build the host emulation of the CUDA kernel")
    return build_emulator(nvcc, str(tmp_path_factory.mktemp("compact_kv_emu") / "compact_kv_emu.so"))
