"""`python -m specdec_kernels.bench.host_cost`: each op's host cost per call, launches and extra kernels.

In a decode loop on a GPU one op call costs the host's work to launch it, not the kernel
(issue #54: 120-930 us per call against about 1 us of memory traffic).  This measures that
work without a GPU, as the issue did, for every public op at a decode-loop shape (B=1, K=4,
N=16, V=49152, bf16; attention H=32, Hkv=8, D=128, S=4096):

* **our Python per call**: the public front called in a loop with ``validate=False`` and the
  backend pinned ("triton"; "native" for ``compact_kv_cache``, which has no Triton kernel), one
  torch thread, under ``torch.inference_mode()`` and under ``torch.no_grad()``, with every Triton
  launch replaced by a counting no-op (so Triton's own launcher is not included) and a fake SM
  count of 132 (an H100's, so the launchers choose their GPU configurations).  Median and
  20th/80th percentiles over blocks of calls, in microseconds.  A native (C++) kernel runs for
  real: its time is included.
* **launches per call**: Triton launches (counted by the no-op) plus calls of the extension's
  ``torch.ops.specdec_native.<op>`` kernels.
* **extra torch kernels per call**: the aten ops that launch a kernel (not views, not empty
  allocations), counted with a ``TorchDispatchMode`` (``KernelCounter``) that also sees inside
  the registered ops' kernels; **host reads** (``aten._local_scalar_dense``: ``.item()``,
  ``int(t)``, ``bool(t)``), which a CUDA-graph step cannot contain; **dispatches**: the
  ``torch.ops.specdec`` ops a call goes through (the dispatcher layers above the kernels).
* **reference points** measured in the same process: ``torch.empty`` of a small tensor, and
  an empty ``torch.library`` op with a Python body.

On CUDA (``--device cuda``) each row also gets the real per-call time and the CUDA-graph replay
time (``specdec_kernels.bench.common.time_fn`` / ``time_graph_replay``); the Python time is
still measured with no-op launches.  Writes a table to stdout and ``host_cost.jsonl`` +
``host_cost.png`` to --out.  ``tests/bench/test_host_cost.py`` runs the ``--quick`` form in CI;
``tests/ops/test_host_cost.py`` asserts the counts (never the times) against issue #54's table.

    python -m specdec_kernels.bench.host_cost [--quick] [--out DIR] [--device cpu|cuda] [--case NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the SM count the launchers are told on CPU (an H100's), so that they choose GPU configurations
FAKE_SM_COUNT = 132
MODES = ("inference_mode", "no_grad")

# aten ops that launch no kernel: allocations without a fill, and bookkeeping (views are
# recognised by ``OpOverload.is_view``)
_NOT_KERNELS = {
    "empty.memory_format",
    "empty_strided.default",
    "new_empty.default",
    "new_empty_strided.default",
    "empty_like.default",
    "detach.default",
    "lift_fresh.default",
    "_local_scalar_dense.default",
    "resize_.default",
    "set_.source_Storage_storage_offset",
    "sym_size.int",
    "sym_stride.int",
    "sym_numel.default",
    "sym_storage_offset.default",
    "is_same_size.default",
}


def _op_name(func) -> str:
    """``namespace::name.overload`` of an ``OpOverload``, e.g. "aten::clamp.default"."""
    return f"{func.namespace}::{func._opname}.{func._overloadname}"


class KernelCounter(TorchDispatchMode):
    """Counts, below autograd, what one call runs: torch kernels, host reads and the
    ``torch.ops.specdec`` ops it dispatches, including the ops run inside a registered op's
    own kernel (the op is redispatched to its device kernel with this mode still on).

    ``specdec_observer``: the fronts take their direct eager path under this mode as without
    it (``specdec_kernels._eager.direct_call``), so what is counted is what a plain call runs.

    Attributes:
        kernels: ``Counter`` of aten op names that launch a kernel (not views, not empty
            allocations).
        host_reads: ``aten._local_scalar_dense`` calls (``.item()``, ``int(t)``, ``bool(t)``).
        dispatches: ``Counter`` of the ``specdec`` ops dispatched (not the ``_native`` kernels).
        native: ``Counter`` of the extension's ``specdec_native::<op>`` kernels called.
    """

    specdec_observer = True

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter = Counter()
        self.host_reads = 0
        self.dispatches: Counter = Counter()
        self.native: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "specdec_native":
            self.native[func._opname] += 1
            return func(*args, **kwargs)
        if func.namespace == "specdec":
            name = func._opname
            self.dispatches[name] += 1
            keys = _device_keyset(args, kwargs)
            if keys is not None:
                with self:  # see the ops inside the registered op's kernel
                    return func.redispatch(keys, *args, **kwargs)
            return func(*args, **kwargs)
        if func.namespace == "aten":
            base = f"{func._opname}.{func._overloadname}"
            if base == "_local_scalar_dense.default":
                self.host_reads += 1
            elif not func.is_view and base not in _NOT_KERNELS:
                self.kernels[_op_name(func)] += 1
        return func(*args, **kwargs)


def _device_keyset(args, kwargs):
    """The dispatch key set of the first tensor's device kernel (CPU or CUDA), or None."""
    for a in list(args) + list(kwargs.values()):
        t = a[0] if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor) else a
        if isinstance(t, torch.Tensor):
            key = {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA}.get(t.device.type)
            return None if key is None else torch._C.DispatchKeySet(key)
    return None


class LaunchCounter:
    """Every Triton launch (``kernel[grid](...)``) while active is counted by kernel name and,
    with ``noop=True``, not run (so neither the kernel nor Triton's own launcher costs
    anything); with ``noop=False`` it runs as usual.  Patches ``triton``'s ``KernelInterface``
    (the class of ``JITFunction`` and of the interpreter's ``InterpretedFunction``) while
    entered."""

    def __init__(self, noop: bool = True) -> None:
        self.noop = noop
        self.launches: Counter = Counter()

    def __enter__(self) -> "LaunchCounter":
        from triton.runtime.jit import KernelInterface

        self._cls, self._saved = KernelInterface, KernelInterface.__getitem__
        counter, saved, noop = self.launches, self._saved, self.noop

        def getitem(kernel, grid):
            name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")

            def run(*args, **kwargs):
                counter[name] += 1
                if not noop:
                    return saved(kernel, grid)(*args, **kwargs)
                return None

            return run

        KernelInterface.__getitem__ = getitem
        return self

    def __exit__(self, *exc) -> None:
        self._cls.__getitem__ = self._saved


@contextlib.contextmanager
def fake_sm_count(count: Optional[int]) -> Iterator[None]:
    """While active, ``specdec_kernels._device.sm_count`` returns ``count`` for every device
    (every module of the package that imported it by name included), so the launchers take
    the configuration of a GPU of ``count`` SMs; None leaves it alone."""
    if count is None:
        yield
        return
    from specdec_kernels import _device

    real = _device.sm_count

    def fake(device):
        return count

    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("specdec_kernels") and getattr(module, "sm_count", None) is real:
            patched.append(module)
            module.sm_count = fake
    try:
        yield
    finally:
        for module in patched:
            module.sm_count = real


@dataclass
class Case:
    """One row: ``call()`` runs the public front once (``validate=False``, backend pinned)."""

    name: str
    op: str
    backend: str
    call: Callable[[], object]
    issue_row: str  # the row of issue #54's table it belongs to


def _probs(shape, g, device, dtype):
    return torch.softmax(torch.randn(shape, generator=g), -1).to(device=device, dtype=dtype)


def make_cases(device: torch.device, dtype: torch.dtype = torch.bfloat16, backend: str = "triton") -> List[Case]:
    """The decode-loop calls of every op (issue #54's shapes) on ``device``; ``backend`` is the
    pinned backend of every op that has it (``compact_kv_cache``: always "native")."""
    import specdec_kernels as sk
    from specdec_kernels.tree import ancestor_mask

    g = torch.Generator().manual_seed(0)
    B, K, N, V = 1, 4, 16, 49152
    H, Hkv, D, S = 32, 8, 128, 4096
    i64 = dict(dtype=torch.int64, device=device)
    kw = dict(backend=backend, validate=False)

    logits = torch.randn(B, K + 1, V, generator=g).to(device=device, dtype=dtype)
    drafts = torch.randint(0, V, (B, K), generator=g).to(device)
    n = torch.full((B,), K, **i64)
    flat_logits = logits.reshape(B * (K + 1), V)
    flat_drafts = drafts.reshape(-1)
    cu = torch.tensor([K], **i64)
    tree_logits = torch.randn(B, N, V, generator=g).to(device=device, dtype=dtype)
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, N)], **i64)  # a binary tree
    tree_tokens = torch.randint(0, V, (B, N), generator=g).to(device)
    num_nodes = torch.full((B,), N, **i64)

    target = _probs((B, K + 1, V), g, device, dtype)
    draft = _probs((B, K, V), g, device, dtype)
    coins = torch.rand(B, K, generator=g).to(device)
    final = torch.rand(B, generator=g).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    seeds, offsets = torch.tensor([7], **i64), torch.tensor([0], **i64)
    flat_target, flat_draft = target.reshape(-1, V), draft.reshape(-1, V)
    # the flattened call's arguments, made before the timed calls (a slice or reshape in the
    # call would be timed as the op's)
    flat_target_rows, flat_coins = flat_target[: K + 1], coins.reshape(-1)
    tree_target, tree_draft = _probs((B, N, V), g, device, dtype), _probs((B, N, V), g, device, dtype)
    tree_coins = torch.rand(B, N - 1, generator=g).to(device)

    q = torch.randn(B, N, H, D, generator=g).to(device=device, dtype=dtype)
    k_cache = torch.randn(B, Hkv, S, D, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(B, Hkv, S, D, generator=g).to(device=device, dtype=dtype)
    lens = torch.full((B,), S - 2 * N, dtype=torch.int32, device=device)
    mask = ancestor_mask(parents.cpu()).to(device)
    block = 16
    pool_k = k_cache.permute(0, 2, 1, 3).reshape(B * S // block, block, Hkv, D)  # NHD blocks, in order
    pool_v = v_cache.permute(0, 2, 1, 3).reshape(B * S // block, block, Hkv, D)
    table = torch.arange(B * S // block, dtype=torch.int32, device=device).reshape(B, S // block)

    L, S_kv = 32, 256
    kv = torch.randn(L, 2, B, Hkv, S_kv, D, generator=g).to(device=device, dtype=dtype)
    kv_lens = torch.full((B,), S_kv // 2, **i64)
    accepted = torch.arange(N, **i64)[None].expand(B, N).contiguous()
    kv_slots = torch.full((B,), 4, **i64)  # the slots to fill (verify's num_accepted + 1), as issue #54 measured

    chain = "verify_greedy / _flattened / verify_tree_greedy"
    rs = "rejection_sample (+ _flattened), explicit uniforms or seeds/offsets"
    attn = "tree_attention, dense and paged"
    return [
        Case("verify_greedy", "verify_greedy", backend, lambda: sk.verify_greedy(logits, drafts, n, **kw), chain),
        Case(
            "verify_greedy_flattened",
            "verify_greedy_flattened",
            backend,
            lambda: sk.verify_greedy_flattened(flat_logits, flat_drafts, cu, max_spec_len=K, **kw),
            chain,
        ),
        Case(
            "verify_tree_greedy",
            "verify_tree_greedy",
            backend,
            lambda: sk.verify_tree_greedy(tree_logits, tree_tokens, parents, num_nodes, **kw),
            chain,
        ),
        Case(
            "rejection_sample uniforms",
            "rejection_sample",
            backend,
            lambda: sk.rejection_sample(target, draft, drafts, n, uniform_samples=coins, sample_uniforms=final, **kw),
            rs,
        ),
        Case(
            "rejection_sample generator",
            "rejection_sample",
            backend,
            lambda: sk.rejection_sample(target, draft, drafts, n, generator=gen, **kw),
            "rejection_sample, a torch.Generator",
        ),
        Case(
            "rejection_sample seeds/offsets",
            "rejection_sample",
            backend,
            lambda: sk.rejection_sample(target, draft, drafts, n, seeds=seeds, offsets=offsets, **kw),
            rs,
        ),
        Case(
            "rejection_sample_flattened uniforms",
            "rejection_sample_flattened",
            backend,
            lambda: sk.rejection_sample_flattened(
                flat_target_rows,
                flat_draft,
                flat_drafts,
                cu,
                max_spec_len=K,
                uniform_samples=flat_coins,
                sample_uniforms=final,
                **kw,
            ),
            rs,
        ),
        Case(
            "tree_rejection_sample uniforms",
            "tree_rejection_sample",
            backend,
            lambda: sk.tree_rejection_sample(
                tree_target,
                tree_tokens,
                parents,
                tree_draft,
                num_nodes,
                uniform_samples=tree_coins,
                sample_uniforms=final,
                **kw,
            ),
            "tree_rejection_sample",
        ),
        Case(
            "sampling_probs top-k+top-p",
            "sampling_probs",
            backend,
            lambda: sk.sampling_probs(logits, temperature=0.7, top_k=50, top_p=0.9, **kw),
            "sampling_probs, top-k + top-p",
        ),
        Case(
            "tree_attention dense",
            "tree_attention",
            backend,
            lambda: sk.tree_attention(q, k_cache, v_cache, lens, mask, **kw),
            attn,
        ),
        Case(
            "tree_attention paged",
            "tree_attention",
            backend,
            lambda: sk.tree_attention(q, pool_k, pool_v, lens, mask, block_table=table, **kw),
            attn,
        ),
        Case(
            "compact_kv_cache",
            "compact_kv_cache",
            "native",
            lambda: sk.compact_kv_cache(kv, kv_lens, accepted, kv_slots, backend="native", validate=False),
            "compact_kv_cache",
        ),
    ]


def _grad_mode(mode: str):
    return torch.inference_mode() if mode == "inference_mode" else torch.no_grad()


def counts(call: Callable[[], object], mode: str = "inference_mode", noop: bool = True) -> Dict[str, object]:
    """What one call of ``call`` runs (after a warm-up call under ``mode``): Triton launches and
    native kernels (``launches``), the torch kernels it launches besides (``extra_kernels``,
    with ``kernel_names``), host reads and ``specdec`` dispatches.  ``noop``: Triton launches
    do not run (CPU).

    Counted under ``torch.no_grad()`` whatever ``mode``: under ``torch.inference_mode()`` torch
    runs ``Tensor.to``'s copy (a dtype cast) below the Python dispatch key, where no dispatch
    mode sees it, so a cast would go uncounted there.  The ops take no other path in either
    mode (their outputs never require grad in both)."""
    with _grad_mode(mode), LaunchCounter(noop):
        call()  # warm-up: first-call work (imports, backend choice) is not per-call work
    launches, counter = LaunchCounter(noop), KernelCounter()
    with torch.no_grad(), launches, counter:
        call()
    return {
        "launches": sum(launches.launches.values()) + sum(counter.native.values()),
        "launch_names": dict(launches.launches) | dict(counter.native),
        "extra_kernels": sum(counter.kernels.values()),
        "kernel_names": dict(counter.kernels),
        "host_reads": counter.host_reads,
        "dispatches": sum(counter.dispatches.values()),
        "dispatch_names": dict(counter.dispatches),
    }


def time_per_call(call: Callable[[], object], blocks: int, block_seconds: float) -> Dict[str, float]:
    """Median, 20th and 80th percentiles and minimum of the time per call over ``blocks``
    blocks of calls (each about ``block_seconds`` long), in microseconds."""
    for _ in range(20):
        call()
    number, elapsed = 1, 0.0
    while elapsed < block_seconds / 4 and number < 1 << 20:  # calls per block
        number *= 2
        t0 = time.perf_counter()
        for _ in range(number):
            call()
        elapsed = time.perf_counter() - t0
    number = max(1, int(number * block_seconds / max(elapsed, 1e-9)))
    per_call = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(number):
            call()
        per_call.append((time.perf_counter() - t0) / number * 1e6)
    per_call.sort()
    pick = lambda q: per_call[min(len(per_call) - 1, int(q * (len(per_call) - 1) + 0.5))]  # noqa: E731
    return {"median_us": statistics.median(per_call), "p20_us": pick(0.2), "p80_us": pick(0.8), "min_us": per_call[0]}


_REFERENCE_OP = {}


def empty_library_op() -> Callable[[torch.Tensor], None]:
    """``torch.ops.specdec_host_cost.empty``: a ``torch.library`` op whose Python body does
    nothing, registered (once, in a namespace of its own) as the public ops are: one kernel for
    CPU and CUDA, autograd falling through."""
    if not _REFERENCE_OP:
        lib = torch.library.Library("specdec_host_cost", "FRAGMENT")

        def empty(x: torch.Tensor) -> None:
            return None

        lib.define("empty(Tensor x) -> ()")
        for key in ("CPU", "CUDA"):
            lib.impl("empty", empty, key)
        lib.impl("empty", torch.library.fallthrough_kernel, "Autograd")
        _REFERENCE_OP["lib"] = lib
        _REFERENCE_OP["op"] = torch.ops.specdec_host_cost.empty.default
    return _REFERENCE_OP["op"]


def reference_points(device: torch.device) -> Dict[str, Callable[[], object]]:
    """Calls to time beside the ops: a small ``torch.empty`` and an empty library op."""
    x = torch.zeros(4, device=device)
    op = empty_library_op()
    return {
        "torch.empty": lambda: torch.empty((1, 5), dtype=torch.int64, device=device),
        "empty torch.library op": lambda: op(x),
    }


def _prepare_triton(device: torch.device) -> Optional[str]:
    """Make the "triton" backend runnable on ``device``: on CPU, the interpreter
    (``TRITON_INTERPRET=1``; the launches are no-ops anyway) unless kernels were already
    imported without it.  Returns why it cannot run, or None."""
    from specdec_kernels import _backend

    if not _backend.triton_available():
        return "triton is not installed"
    if device.type == "cpu" and not _backend.interpreter_on():
        if any(name.startswith("specdec_kernels.ops._triton.") for name in sys.modules):
            return "Triton kernels were imported without TRITON_INTERPRET=1: run in a fresh process"
        os.environ["TRITON_INTERPRET"] = "1"
        _backend.reset()
    return None


def run(args: argparse.Namespace) -> List[Dict]:
    """Measure every case (``make_cases``) and the reference points in both grad modes; write
    the JSON lines and the plot; print the table.  Returns the rows.

    Args:
        args: ``main``'s parsed flags (``quick``, ``out``, ``device``, ``case``).

    Raises:
        SystemExit: an unwritable ``--out``, an unknown ``--case``, or no Triton backend here.
    """
    from specdec_kernels.bench.common import out_dir

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        out = out_dir(args.out, "bench_out")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    reason = _prepare_triton(device)
    if reason:
        raise SystemExit(f"error: the host-cost benchmark pins the Triton backend: {reason}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(args, device, out)
    finally:
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace, device: torch.device, out) -> List[Dict]:
    from specdec_kernels.bench.common import environment, write_jsonl

    env = environment()
    sm = FAKE_SM_COUNT if device.type == "cpu" else None
    blocks, block_seconds = (5, 0.01) if args.quick else (31, 0.05)
    cases = [c for c in make_cases(device) if args.case in (None, c.name)]
    if not cases:
        raise SystemExit(f"error: --case must be one of {[c.name for c in make_cases(device)]}")
    rows = []
    with fake_sm_count(sm):
        for name, call in reference_points(device).items():
            for mode in MODES:
                with _grad_mode(mode):
                    t = time_per_call(call, blocks, block_seconds)
                rows.append(dict(case=name, op=None, backend=None, mode=mode, reference_point=True, **t))
        for case in cases:
            for mode in MODES:
                c = counts(case.call, mode)
                with _grad_mode(mode), LaunchCounter(noop=True):
                    t = time_per_call(case.call, blocks, block_seconds)
                row = dict(
                    case=case.name,
                    op=case.op,
                    backend=case.backend,
                    mode=mode,
                    issue_row=case.issue_row,
                    reference_point=False,
                    **t,
                    **c,
                )
                if device.type == "cuda" and mode == "inference_mode":
                    row.update(_gpu_times(case.call, device))
                rows.append(row)
                print(
                    f"# measured {case.name} ({case.backend}, {mode}): median {t['median_us']:.1f} us, "
                    f"{c['launches']} launches, {c['extra_kernels']} extra kernels",
                    file=sys.stderr,
                    flush=True,
                )
    meta = {
        **env,
        "threads": 1,
        "validate": False,
        "fake_sm_count": sm,
        "launches_replaced_by_noops": True,
    }
    write_jsonl(out / "host_cost.jsonl", rows, meta)
    plot(rows, out / "host_cost.png", env)
    print(report(rows, env, sm))
    print(f"# wrote {out / 'host_cost.jsonl'} and {out / 'host_cost.png'}")
    return rows


def _gpu_times(call: Callable[[], object], device: torch.device) -> Dict[str, Optional[float]]:
    """Real per-call time and CUDA-graph replay time of ``call`` (launches run), in us."""
    from specdec_kernels.bench.common import time_fn, time_graph_replay

    with torch.inference_mode():
        real = time_fn(call, device, 0.2)
        graph = time_graph_replay(call, device)
    return {"real_median_us": real["median_us"], "graph_median_us": graph["median_us"] if graph else None}


def report(rows: Sequence[Dict], env: Dict[str, str], sm: Optional[int]) -> str:
    """The table: one line per case (inference_mode and no_grad side by side)."""
    from specdec_kernels.bench.common import column, format_table

    merged: Dict[str, Dict] = {}
    for r in rows:
        m = merged.setdefault(r["case"], {"case": r["case"], "backend": r.get("backend")})
        tag = "inf" if r["mode"] == "inference_mode" else "nog"
        for k in ("median_us", "p20_us", "p80_us"):
            m[f"{tag}_{k}"] = r[k]
        for k in ("launches", "extra_kernels", "host_reads", "dispatches", "real_median_us", "graph_median_us"):
            if r.get(k) is not None and tag == "inf":
                m[k] = r[k]
    head = (
        f"# host cost per call on {env['device']}, torch {env['torch']}, commit {env['commit']}: validate=False, "
        f"1 thread, Triton launches replaced by no-ops"
        + (f", fake SM count {sm}" if sm else "")
        + "; us per call, median [p20, p80]"
    )
    table = format_table(
        list(merged.values()),
        [
            column("case"),
            column("backend"),
            column("inf_median_us", "inference_mode us", "{:.1f}"),
            column("inf_p20_us", "p20", "{:.1f}"),
            column("inf_p80_us", "p80", "{:.1f}"),
            column("nog_median_us", "no_grad us", "{:.1f}"),
            column("nog_p20_us", "p20", "{:.1f}"),
            column("nog_p80_us", "p80", "{:.1f}"),
            column("launches"),
            column("extra_kernels", "extra kernels"),
            column("host_reads", "host reads"),
            column("dispatches"),
            column("real_median_us", "real us", "{:.1f}"),
            column("graph_median_us", "graph us", "{:.1f}"),
        ],
    )
    return head + "\n" + table


def plot(rows: Sequence[Dict], path, env: Dict[str, str]) -> None:
    """Horizontal bars: each case's median us per call under inference_mode and no_grad
    (whiskers: 20th to 80th percentile); the reference points as vertical lines."""
    from specdec_kernels.bench.common import pyplot_or_none, save_figure

    plt = pyplot_or_none(path)
    if plt is None:
        return
    cases = list(dict.fromkeys(r["case"] for r in rows if not r["reference_point"]))
    fig, ax = plt.subplots(figsize=(9, 0.45 * max(len(cases), 1) + 1.6))
    height = 0.38
    for j, mode in enumerate(MODES):
        mine = {r["case"]: r for r in rows if r["mode"] == mode and not r["reference_point"]}
        ys = [i + (j - 0.5) * height for i in range(len(cases))]
        med = [mine[c]["median_us"] for c in cases]
        err = [
            [mine[c]["median_us"] - mine[c]["p20_us"] for c in cases],
            [mine[c]["p80_us"] - mine[c]["median_us"] for c in cases],
        ]
        ax.barh(ys, med, height, xerr=err, label=mode, capsize=2)
    styles = iter(["--", ":", "-."])
    for r in rows:
        if r["reference_point"] and r["mode"] == "inference_mode":
            ax.axvline(r["median_us"], color="k", lw=0.8, ls=next(styles, "--"), label=f"{r['case']}")
    ax.set_xscale("log")
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(cases, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("our Python per call, us (launches replaced by no-ops)")
    ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path, f"host cost per call on {env['device']} (commit {env['commit']})")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line (module docstring); writes the table, ``host_cost.jsonl`` and
    ``host_cost.png``."""
    from specdec_kernels.bench.common import ArgumentParser, check_device, out_dir

    parser = ArgumentParser(prog="python -m specdec_kernels.bench.host_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few short timing blocks (CI smoke test)")
    parser.add_argument("--out", help="output folder (default bench_out/)")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--case", help="one case only (its name in the table)")
    args = parser.parse_args(argv)
    check_device(parser, "--device", args.device)
    try:
        out_dir(args.out, "bench_out")  # checked before any work
    except ValueError as e:
        parser.error(str(e))
    run(args)


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
