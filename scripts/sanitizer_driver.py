"""A small driver of the CUDA KV-cache compaction for compute-sanitizer (scripts/compute_sanitizer.sh):
the kernel's access patterns in a few calls, without pytest's start-up and collection.

Cases: one [L, 2, B, Hkv, S, D] buffer (the strided form), separately allocated layers (the device
table of addresses, built on the first call and kept), a paged pool in NHD and HND, head dims whose
rows are not a whole number of 16-byte words (narrower words), out-of-range indices and counts with
validation off (the kernel must skip them, not read or write outside the caches), and a batch whose
rows move onto each other (loads before stores).  Each result is compared byte for byte with the
reference backend on copies of the same inputs.

    python scripts/sanitizer_driver.py            # exit 0: every case equal to the reference
    python scripts/sanitizer_driver.py --device cpu   # the same cases on the C++ CPU kernel (CI)
"""

from __future__ import annotations

import sys

import torch

import specdec_kernels as sk


def _cases(device: torch.device):
    g = torch.Generator().manual_seed(0)
    L, B, Hkv, S, M = 2, 3, 2, 48, 6
    for D, dtype in ((64, torch.bfloat16), (67, torch.float16), (8, torch.float32)):
        kv = torch.randn(L, 2, B, Hkv, S, D, generator=g).to(device=device, dtype=dtype)
        lens = torch.tensor([0, 10, 40], device=device)
        idx = torch.sort(torch.randint(0, S - 40, (B, M), generator=g), dim=1).values.to(device)
        slots = torch.tensor([M, 3, 0], device=device)
        yield f"buffer D={D} {dtype}", dict(kv_cache=kv, cache_seqlens=lens, accepted_indices=idx, num_slots=slots)
        layers = [kv[i, j].clone() for i in range(L) for j in range(2)]  # separate allocations
        yield f"layer list D={D}", dict(kv_cache=layers, cache_seqlens=lens, accepted_indices=idx, num_slots=slots)
    # validation off: indices past the capacity and counts past M are skipped by the kernel
    kv = torch.randn(1, 2, 2, 2, 16, 32, generator=g).to(device=device, dtype=torch.bfloat16)
    bad = torch.tensor([[0, 5, 99, 15], [1, 2, 3, 1000]], device=device)
    yield (
        "out of range (run, not compared: the result is unspecified)",
        dict(
            kv_cache=kv,
            cache_seqlens=torch.tensor([12, 0], device=device),
            accepted_indices=bad,
            num_slots=torch.tensor([4, 4], device=device),
        ),
    )
    # paged pools, NHD and HND, 4-slot blocks, a shuffled block table
    for layout in ("NHD", "HND"):
        blocks, bs = 12, 4
        shape = (1, 2, blocks, bs, 2, 16) if layout == "NHD" else (1, 2, blocks, 2, bs, 16)
        pool = torch.randn(*shape, generator=g).to(device=device, dtype=torch.float16)
        table = torch.randperm(blocks, generator=g)[:8].view(2, 4).to(device=device, dtype=torch.int32)
        yield (
            f"paged {layout}",
            dict(
                kv_cache=pool,
                cache_seqlens=torch.tensor([3, 5], device=device),
                accepted_indices=torch.tensor([[0, 2, 3, 6], [0, 1, 4, 9]], device=device),
                num_slots=torch.tensor([4, 3], device=device),
                block_table=table,
                kv_layout=layout,
            ),
        )


def _clone(args):
    out = dict(args)
    kv = args["kv_cache"]
    out["kv_cache"] = [t.clone() for t in kv] if isinstance(kv, list) else kv.clone()
    return out


def _same(a, b) -> bool:
    if isinstance(a, list):
        return all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def main(argv=None) -> int:
    """Run every case on CUDA (``--device cpu``: the C++ CPU kernel, how CI checks the driver)."""
    argv = sys.argv[1:] if argv is None else argv
    device = torch.device("cpu" if argv[-2:] == ["--device", "cpu"] else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("sanitizer_driver: no CUDA device; nothing run")
        return 0
    failures = 0
    for name, args in _cases(device):
        ours, ref = _clone(args), _clone(args)
        sk.compact_kv_cache(**ours, backend="native", validate=False)
        if "not compared" in name:
            print(f"sanitizer_driver: {name}: ran")
            continue
        sk.compact_kv_cache(**ref, backend="reference", validate=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ok = _same(ours["kv_cache"], ref["kv_cache"])
        failures += not ok
        print(f"sanitizer_driver: {name}: {'same bytes as the reference' if ok else 'DIFFERS from the reference'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
