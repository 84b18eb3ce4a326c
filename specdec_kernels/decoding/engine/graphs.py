"""The target's verification pass captured once per bucket and replayed (CUDA graphs).

A decode step on a GPU is bound by the host launching the target's kernels one by one.  With
``SpeculativeDecoder(cuda_graphs=True)`` the loop pads every step's block to a bucket width
(``node_buckets``) and ``CapturedPasses`` runs the target's pass of each (batch, width, chain
or tree, outputs) shape class as a CUDA graph: the first pass of a class runs eagerly (it warms
up the kernels, writes the KV cache and gives the step its logits) and is then captured; every
later one copies its inputs (tokens, positions, tree mask) into the graph's static buffers and
replays it.  The KV cache and ``cache_seqlens`` are the state's own tensors, read by the graph
in place: the pass reads no value on the host (``host_seqlens`` is not given to it), so the
captured kernels find their slots from the device's ``cache_seqlens``.

``graph`` is the capture mechanism: ``torch.cuda.CUDAGraph`` on CUDA; ``EagerGraph`` re-runs
the pass into the same static outputs, so that the same code path (static buffers, shape
classes, output copies) runs and is tested on CPU.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch


class EagerGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` on CPU: ``capture(fn)`` keeps the pass,
    ``replay()`` runs it again and writes its outputs into the captured ones."""

    def __init__(self):
        self._fn: Optional[Callable[[], Tuple[torch.Tensor, ...]]] = None
        self._outputs: Tuple[torch.Tensor, ...] = ()

    def capture(self, fn: Callable[[], Tuple[torch.Tensor, ...]]) -> Tuple[torch.Tensor, ...]:
        self._fn = fn
        self._outputs = tuple(t.clone() for t in fn())
        return self._outputs

    def replay(self) -> None:
        for static, fresh in zip(self._outputs, self._fn()):
            static.copy_(fresh)


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind ``EagerGraph``'s interface; the graphs of one
    ``CapturedPasses`` share a memory pool."""

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], Tuple[torch.Tensor, ...]]) -> Tuple[torch.Tensor, ...]:
        with torch.cuda.graph(self.graph, pool=self.pool):
            outputs = fn()
        return outputs

    def replay(self) -> None:
        self.graph.replay()

    @classmethod
    def factory(cls) -> Callable[[], "CudaGraph"]:
        """A factory of graphs sharing one memory pool (made on the first graph)."""
        shared = {}

        def make() -> "CudaGraph":
            if "pool" not in shared:
                shared["pool"] = torch.cuda.graph_pool_handle()
            return cls(shared["pool"])

        return make


class CapturedPasses:
    """The target's verification passes, one captured graph per shape class.

    Args:
        model: the target (a ``Transformer``; its call interface).
        graph: a factory of graph objects (``CudaGraph`` on CUDA, ``EagerGraph`` on CPU).
        max_graphs: the most shape classes kept (the buckets times chain / tree times the
            batch sizes seen); beyond it the oldest is dropped.

    ``run(...)`` takes the loop's arguments of ``model(...)`` and returns what the model
    returns; the tensors returned belong to the graph (the next ``run`` of the same class
    overwrites them), so the caller consumes them within its step.
    """

    def __init__(self, model, graph: Callable[[], object], max_graphs: int = 64):
        self.model = model
        self.graph = graph
        self.max_graphs = int(max_graphs)
        self._entries: Dict[tuple, dict] = {}
        self.captures = 0  # shape classes captured so far (a benchmark reads it)
        self.replays = 0

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        tree_mask: Optional[torch.Tensor],
        return_hidden: bool = False,
        hidden_layers: Sequence[int] = (),
    ):
        """``model(tokens, positions, kv_cache, cache_seqlens, tree_mask, return_hidden=...,
        hidden_layers=...)`` through the captured graph of its shape class."""
        key = (
            tuple(tokens.shape),
            None if tree_mask is None else tuple(tree_mask.shape),
            bool(return_hidden),
            tuple(hidden_layers),
            kv_cache.data_ptr(),
            cache_seqlens.data_ptr(),
        )
        entry = self._entries.get(key)
        if entry is None:
            return self._first(key, tokens, positions, kv_cache, cache_seqlens, tree_mask, return_hidden, hidden_layers)
        entry["tokens"].copy_(tokens)
        entry["positions"].copy_(positions)
        if tree_mask is not None:
            entry["mask"].copy_(tree_mask)
        entry["graph"].replay()
        self.replays += 1
        out = entry["outputs"]
        return (out[0], out[1]) if return_hidden else out[0]

    def _first(self, key, tokens, positions, kv_cache, cache_seqlens, tree_mask, return_hidden, hidden_layers):
        """The class's first pass: eager (its results are this step's), then captured."""
        kwargs = {"return_hidden": True, "hidden_layers": tuple(hidden_layers)} if return_hidden else {}
        result = self.model(tokens, positions, kv_cache, cache_seqlens, tree_mask, **kwargs)
        if self._entries and next(iter(self._entries))[4:] != key[4:]:
            self._entries.clear()  # another state's cache: the old graphs read freed memory
        while len(self._entries) >= self.max_graphs:
            self._entries.pop(next(iter(self._entries)))
        static = {
            "tokens": tokens.clone(),
            "positions": positions.clone(),
            "mask": tree_mask.clone() if tree_mask is not None else None,
        }

        def captured_pass():
            out = self.model(static["tokens"], static["positions"], kv_cache, cache_seqlens, static["mask"], **kwargs)
            return tuple(out) if return_hidden else (out,)

        graph = self.graph()
        static["outputs"] = graph.capture(captured_pass)
        static["graph"] = graph
        self._entries[key] = static
        self.captures += 1
        return result
