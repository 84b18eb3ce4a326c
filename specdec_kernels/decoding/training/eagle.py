"""Train the EAGLE-style draft head (``decoding.drafters.eagle``) by self-distillation on CPU.

    python -m specdec_kernels.decoding.training.eagle [--steps N] [--out PATH] [--seed S]

1. Data: the pipeline Medusa's trainer uses (``training.data``): Spec-Bench prompts (the
   first 4 questions of every category held out), the target's own greedy continuations
   and its final hidden state (after its final norm) at every position, cached on disk
   (the same cache: one generation serves both trainers).
2. Examples: segments of ``--segment`` consecutive positions of one sequence.  At
   position t the head reads (f_t, x_{t+1}) and predicts f_{t+1} and the target's
   distribution over x_{t+2} (soft labels: the target's output head on f_{t+1}; hard
   label: the target's argmax, which past the prompt is the text itself).  The head's
   attention is causal over the segment, like the drafter's sliding window over the
   committed positions (``window`` = ``--segment``).
3. Training-time test (EAGLE-3, Li et al. 2025): ``--unroll`` U steps.  Step s >= 2 feeds
   the head its own step s - 1 output at every t (the feature the drafter will have at
   depth s), with the text's token x_{t+s}, at position t + s - 1; its query attends to the
   real positions <= t and to its own chain's earlier steps.  Step s learns f_{t+s} and the
   target's distribution over x_{t+s+1}.
4. Loss per step: cross-entropy against the soft labels (``--distill``, mixed with the
   hard label) through the frozen output head as a sampled softmax (``training.softmax``;
   bfloat16 logits) plus ``--reg`` x smooth L1 between the predicted and the true feature
   (EAGLE's regression term), weighted 0.8^(s-1).  AdamW, warm-up and cosine decay,
   minibatches of ``--segments`` segments drawn with ``--seed``.
5. Report: on the tuning set (questions 3-4 of every category), the head's top-1 agreement
   with the target at each unrolled depth and the expected accepted length of a chain;
   ``--evaluate`` then decodes the held-out bench prompts (the first 2 of each category)
   at temperature 0, chain and dynamic tree, and checks the outputs equal greedy.

``--feature-layers 1,14,26`` trains an EAGLE-3 head: it also reads those target layers' outputs
(EAGLE-3's low-, mid- and high-level features, fused with f_t; ``EagleHead``), which a
teacher-forced pass of the target over each cached sequence computes (cached beside the data).
With ``--init`` of an EAGLE head the fusion starts as the identity on f_t, so training starts
from the old head's drafts.

``--init PATH`` starts from a head file's weights instead of a fresh head (fine-tuning on new
data); the new file records the old one's training under ``config["training"]["init"]``.
``--written-per-category N`` adds training prompts the target writes itself (``training.instruct``).

The shipped ``specdec_kernels/data/eagle/smollm2-135m-instruct.pt`` was made with the
command stored in its ``config["training"]["command"]`` (see docs/ENGINE.md).  ``--random-model``
runs the whole pipeline on a tiny random Llama (a smoke test, seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from specdec_kernels.checks import layer_indices
from specdec_kernels.decoding.drafters.eagle import SHIPPED, EagleDrafter, EagleHead
from specdec_kernels.decoding.model import Transformer
from specdec_kernels.decoding.training.data import (
    SelfDistilled,
    add_data_arguments,
    add_training_arguments,
    check_data_arguments,
    check_training_arguments,
    comma_list,
    default_cache_dir,
    evaluate_drafters,
    flags_at_least,
    float16_rows,
    length_batches,
    prepare,
    training_options,
    training_record,
)
from specdec_kernels.decoding.training.softmax import (
    TrainingOptions,
    candidate_logits,
    hard_and_soft_losses,
    label_ranking,
)
from specdec_kernels.files import BadFileError, atomic_torch_save, load_torch

PROG_MODULE = "specdec_kernels.decoding.training.eagle"
STEP_DECAY = 0.8  # weight of unrolled step s: STEP_DECAY ** (s - 1)
DRAFT_VOCAB = 4096  # the recommended draft vocabulary: the sampled softmax's always-present labels (--frequent)


class FeatureRows(NamedTuple):
    """Every recorded position of the data, sequence after sequence.

    states: (N, H) fp16 f_t ((N, (1 + k) H) with k feature layers: their outputs
    appended); next_tokens: (N,) x_{t+1} (the text); labels: (N,) the target's argmax
    after position t (= x_{t+1} past the prompt); seq_end: (N,) the row after the last row
    of each row's sequence.
    """

    states: torch.Tensor
    next_tokens: torch.Tensor
    labels: torch.Tensor
    seq_end: torch.Tensor


def recorded_rows(data: SelfDistilled, s: int) -> int:
    """How many of sequence s's recorded positions have a next token (the rows it trains on)."""
    return max(0, min(data.hidden[s].shape[0], len(data.tokens[s]) - 1 - data.first[s]))


def feature_rows(
    data: SelfDistilled,
    output_weight: torch.Tensor,
    chunk: int = 2048,
    layer_outputs: Optional[List[torch.Tensor]] = None,
) -> FeatureRows:
    """The rows of ``data`` with their next tokens and the target's predictions (its argmax
    through ``output_weight`` where the next token is a prompt token; the text elsewhere,
    which the target generated greedily).  Sequences with fewer than 2 rows are dropped.
    ``layer_outputs`` (one (rows, k H) tensor per sequence, ``layer_outputs``): appended to
    each row's final hidden state.  Data recorded with feature layers (hidden states wider
    than H, ``generate_data``) keeps its whole rows; its first H columns give the labels."""
    W = output_weight.detach().float()
    H = W.shape[1]
    states, nexts, labels, ends = [], [], [], []
    n = 0
    for i, (toks, P, first, h) in enumerate(zip(data.tokens, data.prompt_lengths, data.first, data.hidden)):
        rows = recorded_rows(data, i)
        if rows < 2:
            continue
        h = h[:rows]
        nxt = torch.tensor(toks[first + 1 : first + 1 + rows], dtype=torch.int64)
        lab = nxt.clone()
        n_prompt = max(0, min(rows, P - 1 - first))  # rows whose next token is a prompt token
        for s in range(0, n_prompt, chunk):
            e = min(s + chunk, n_prompt)
            lab[s:e] = (h[s:e, :H].float() @ W.T).argmax(-1)
        states.append(h.to(torch.float16))
        if layer_outputs is not None:
            states[-1] = torch.cat([states[-1], layer_outputs[i][:rows].to(torch.float16)], dim=-1)
        nexts.append(nxt)
        labels.append(lab)
        n += rows
        ends.append(torch.full((rows,), n, dtype=torch.int64))
    if not states:
        raise ValueError("the data holds no sequence with at least 2 recorded positions")
    return FeatureRows(torch.cat(states), torch.cat(nexts), torch.cat(labels), torch.cat(ends))


@torch.inference_mode()
def layer_outputs(
    model: Transformer,
    data: SelfDistilled,
    layers: Sequence[int],
    cache: Optional[Path] = None,
    max_batch: int = 8,
    max_tokens: int = 4096,
) -> List[torch.Tensor]:
    """The outputs of the target's ``layers`` at every training row of ``data`` (per
    sequence (``recorded_rows``, len(layers) H) fp16, positions ``first`` on), from a
    teacher-forced pass over each sequence's tokens, in right-padded batches of similar
    length (at most ``max_batch`` sequences and ``max_tokens`` padded tokens; padding after
    a sequence changes none of its positions).  Cached in the directory ``cache`` (None: not
    cached) under a hash of the model's fingerprint, the layers and the sequences; a cache
    file that cannot be read, or holds other shapes, is reported with a RuntimeWarning naming
    it and recomputed.

    Raises:
        ValueError: ``layers`` empty or outside the model (``Transformer.forward``); an output
            beyond float16's range (the residual streams are stored unnormalised in float16).
    """
    from specdec_kernels.optional import require

    tqdm = require("tqdm", purpose="training the heads (progress bars)", extra="engine").tqdm
    if not layers:
        raise ValueError("layers must name at least one layer")
    layers = tuple(int(i) for i in layers)
    H = model.args.hidden_size
    counts = [recorded_rows(data, s) for s in range(len(data.tokens))]
    ends = [data.first[s] + counts[s] for s in range(len(counts))]  # the positions a pass must reach
    path = _layer_outputs_path(model, data, layers, ends, cache)
    out = _cached_layer_outputs(path, [(c, len(layers) * H) for c in counts])
    if out is not None:
        return out
    out = [torch.zeros(c, len(layers) * H, dtype=torch.float16) for c in counts]
    todo = [s for s in range(len(counts)) if counts[s]]
    batches = length_batches([ends[s] for s in todo], max_batch, max_tokens)
    for batch in tqdm(batches, desc=f"layer outputs {list(layers)}", unit="batch", file=sys.stderr):
        seqs = [todo[j] for j in batch]
        hidden = _teacher_forced(model, [data.tokens[s][: ends[s]] for s in seqs], layers)
        for r, s in enumerate(seqs):
            f = data.first[s]
            out[s] = float16_rows(hidden[r, f : f + counts[s], H:], layers)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(out, path)
    return out


def _layer_outputs_path(
    model: Transformer, data: SelfDistilled, layers: tuple, ends: List[int], cache: Optional[Path]
) -> Optional[Path]:
    """``layer_outputs``' cache file in the directory ``cache`` (None: not cached), named by a hash of
    the model's fingerprint, the layers, the sequences up to ``ends`` and the pass's numerics."""
    from specdec_kernels.decoding.drafters.head_file import model_fingerprint

    parts = [model_fingerprint(model), layers, data.first, [t[:e] for t, e in zip(data.tokens, ends)]]
    if model.numerics != "float32":  # the pass's numerics (a float32 pass keeps the name it had)
        parts.append(model.numerics)
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    return None if cache is None else Path(cache) / f"layers-{key}.pt"


def _cached_layer_outputs(path: Optional[Path], shapes: List[tuple]) -> Optional[List[torch.Tensor]]:
    """The layer outputs cached at ``path`` when it holds tensors of these ``shapes``, else None (a
    file that cannot be read, or holds others, is reported with a RuntimeWarning naming it)."""
    if path is None or not path.is_file():
        return None
    try:
        out = load_torch(path, "layer-output cache")
        if not (isinstance(out, list) and [getattr(o, "shape", None) for o in out] == shapes):
            raise BadFileError(path, "not the layer outputs of these sequences")
    except BadFileError as e:
        warnings.warn(f"specdec_kernels: {e}; recomputing it", RuntimeWarning, stacklevel=3)
        return None
    print(f"(layer outputs from the cache {path})", file=sys.stderr)
    return out


def _teacher_forced(model: Transformer, sequences: List[List[int]], layers: tuple) -> torch.Tensor:
    """One pass of the target over the ``sequences`` (right-padded to the longest, T): its final
    hidden states with the ``layers``' outputs appended, (len(sequences), T, (1 + len(layers)) H)."""
    T = max(len(t) for t in sequences)
    tokens = torch.zeros(len(sequences), T, dtype=torch.int64)
    for r, t in enumerate(sequences):
        tokens[r, : len(t)] = torch.tensor(t, dtype=torch.int64)
    dev = model.device
    kv = model.new_kv_cache(len(sequences), T)
    _, hidden = model(
        tokens.to(dev),
        torch.arange(T, device=dev).expand(len(sequences), T),
        kv,
        torch.zeros(len(sequences), dtype=torch.int32, device=dev),
        return_hidden=True,
        compute_logits=False,
        hidden_layers=layers,
    )
    return hidden


def unrolled(
    head: EagleHead,
    embedding: torch.Tensor,
    f: torch.Tensor,
    next_tokens: torch.Tensor,
    valid: torch.Tensor,
    unroll: int,
) -> List[torch.Tensor]:
    """The head's outputs over segments with training-time test.

    Args:
        f: (B, L + U, H) features of consecutive positions (the segment and U more rows);
            (B, L + U, (1 + k) H) for a head with k ``feature_layers``.
        next_tokens: (B, L + U) the token after each row.
        valid: (B, L + U) bool, rows that belong to the segment's sequence.
        unroll: U >= 1.

    Returns:
        U tensors (B, L, H): step s's g_t (the prediction of f_{t+s}) for t in 0..L-1.
    """
    B, T, H = f.shape
    L = T - unroll
    dev = f.device
    E = embedding
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(L, dtype=torch.bool, device=dev)
    real_mask = (causal[None] & valid[:, None, :L]) | eye
    pos = torch.arange(L, device=dev).expand(B, L)
    u = head.inputs(head.fuse_features(f[:, :L]), E[next_tokens[:, :L]])
    q, k1, v1 = head.project(u, pos)
    g = head.finish(u, head.attend(q, k1, v1, real_mask))
    outs, keys, values = [g], [k1], [v1]
    for s in range(2, unroll + 1):
        u = head.inputs(g, E[next_tokens[:, s - 1 : s - 1 + L]])
        q, k, v = head.project(u, pos + s - 1)
        keys.append(k)
        values.append(v)
        mask = torch.cat([real_mask] + [eye.expand(B, L, L)] * (s - 1), dim=2)
        g = head.finish(u, head.attend(q, torch.cat(keys, 1), torch.cat(values, 1), mask))
        outs.append(g)
    return outs


def train_head(
    head: EagleHead,
    model: Transformer,
    rows: FeatureRows,
    options: TrainingOptions,
    *,
    segments: int,
    segment: int,
    unroll: int,
    reg: float = 0.1,
    hass_top_k: int = 0,
    hass_weight: float = 1.0,
) -> List[float]:
    """Train ``head`` on the feature rows (see the module docstring); returns every step's loss.

    Args:
        options: the optimiser's schedule, the sampled softmax and ``distill``, the weight
            of the soft labels (``TrainingOptions``; the command line's default is 1).
        segments: segments per minibatch.
        segment: consecutive positions per segment (the drafter's window).
        unroll: training-time test steps (1: teacher forcing only).
        reg: weight of the feature regression (smooth L1).
        hass_top_k: K of HASS's harmonized objective distillation (Zhang et al. 2025): a
            term -sum over the target's K most likely candidates of p(x) log q(x) joins each
            step's loss (``hard_and_soft_losses``); 0: none.
        hass_weight: that term's weight.

    Raises:
        ValueError: segments, segment or unroll < 1; reg, hass_top_k or hass_weight < 0 or
            not finite; hass_top_k not an int.
    """
    for name, v in (("segments", segments), ("segment", segment), ("unroll", unroll)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    step_loss = _StepLoss(options.distill, reg, hass_top_k, hass_weight)
    g = options.generator()
    E = model.tok_embeddings.weight.detach().float()
    softmax, W_bf = options.softmax(model.output.weight, rows.labels)
    N, L, U = rows.states.shape[0], segment, unroll
    head.float().train()
    offsets = torch.arange(L + U)
    optimiser = options.optimiser(head.parameters())
    for _ in optimiser.run(options.desc):
        start = torch.randint(0, N, (segments,), generator=g)
        idx = start[:, None] + offsets  # (B, L + U)
        valid = idx < rows.seq_end[start][:, None]
        idx = torch.minimum(idx, rows.seq_end[start][:, None] - 1)
        f = rows.states[idx].float()
        outs = unrolled(head, E, f, rows.next_tokens[idx], valid, U)
        f = f[..., : head.hidden_size]  # the truth: the final hidden states
        # step s at row t: the truth is row t + s (its feature; the target's distribution
        # over the token after it and its argmax)
        labels = torch.stack(
            [torch.where(valid[:, s : s + L], rows.labels[idx[:, s : s + L]], -100) for s in range(1, U + 1)]
        )
        c = softmax.draw(labels, g)
        optimiser.step(step_loss(outs, f, valid, labels, c, W_bf[c.tokens].T))
    head.eval()
    return optimiser.losses


@dataclass
class _StepLoss:
    """``train_head``'s loss of a minibatch (see its arguments), checked.

    Raises:
        ValueError: reg, hass_top_k or hass_weight < 0 or not finite; hass_top_k not an int.
    """

    distill: float
    reg: float
    hass_top_k: int
    hass_weight: float

    def __post_init__(self) -> None:
        for name in ("reg", "hass_top_k", "hass_weight"):
            v = getattr(self, name)
            if not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if isinstance(self.hass_top_k, bool) or not isinstance(self.hass_top_k, int):
            raise ValueError(f"hass_top_k must be an int, got {self.hass_top_k!r}")

    def __call__(self, outs, f, valid, labels, c, W_c) -> torch.Tensor:
        """The steps' losses weighted STEP_DECAY^(s - 1): ``outs`` U tensors (B, L, H) from
        ``unrolled``, the true features f (B, L + U, H), valid (B, L + U), labels (U, B, L) (-100:
        none), the sampled softmax's candidates ``c`` and their output-head columns W_c."""
        L = outs[0].shape[1]
        total = torch.zeros(())
        weight = 0.0
        for s, out in enumerate(outs, start=1):
            truth = f[:, s : s + L]
            ok = valid[:, s : s + L]
            logits = candidate_logits(out, W_c, c.bias)
            hard, soft, top = hard_and_soft_losses(
                logits, c.targets(labels[s - 1]), truth, W_c, c.bias, top_k=self.hass_top_k
            )
            per = (1 - self.distill) * hard + self.distill * soft
            if top is not None:
                per = per + self.hass_weight * top
            if self.reg:
                per = per + self.reg * F.smooth_l1_loss(out, truth, reduction="none").mean(-1)
            w = STEP_DECAY ** (s - 1)
            total = total + w * torch.where(ok, per, 0.0).sum() / ok.sum().clamp(min=1)
            weight += w
        return total / weight


@torch.no_grad()
def agreement(
    head: EagleHead,
    model: Transformer,
    rows: FeatureRows,
    unroll: int,
    segment: int,
    draft_vocab: Optional[torch.Tensor] = None,
) -> Dict[str, object]:
    """Top-1 agreement of the head with the target at each unrolled depth (teacher-forced
    tokens, the head's own features), over consecutive segments of every sequence, and the
    expected accepted length of a chain of ``unroll`` drafts (1 + the sum over depths of
    the fraction of positions whose first d drafts all agree), and the positions scored at
    each depth (every row t of a sequence whose row t + d exists).  ``draft_vocab`` (ids,
    int64): the head's argmax over those tokens only, as the drafter's draft vocabulary."""
    E = model.tok_embeddings.weight.detach().float()
    W = model.output.weight.detach().float()
    ids = None if draft_vocab is None else draft_vocab.to(torch.int64)
    if ids is not None:
        W = W[ids]
    head_dt = next(head.parameters()).dtype
    head.float()
    L = segment
    hits = [[] for _ in range(unroll)]
    ends = torch.unique_consecutive(rows.seq_end).tolist()
    for first, end in zip([0] + ends[:-1], ends):  # each sequence in segments of L consecutive rows
        for s0 in range(first, end, L):
            idx = (s0 + torch.arange(L + unroll))[None]
            valid = idx < end
            idx = torch.minimum(idx, torch.tensor(end - 1))
            outs = unrolled(head, E, rows.states[idx].float(), rows.next_tokens[idx], valid, unroll)
            for s, out in enumerate(outs, start=1):
                ok = valid[0, s : s + L]
                pred = (out[0] @ W.T).argmax(-1)
                if ids is not None:
                    pred = ids[pred]
                hits[s - 1].append(torch.where(ok, (pred == rows.labels[idx[0, s : s + L]]).long(), -1))
    head.to(head_dt)
    H = [torch.cat(h) for h in hits]
    top1 = [float((h[h >= 0] == 1).float().mean()) if (h >= 0).any() else 0.0 for h in H]
    all_ok = torch.ones_like(H[0], dtype=torch.bool)
    expected = 1.0
    for h in H:  # a position counts where every depth is defined
        all_ok = all_ok & (h == 1)
        expected += float(all_ok[H[-1] >= 0].float().mean()) if (H[-1] >= 0).any() else 0.0
    return {"top1": top1, "chain_expected_accepted_length": expected, "positions": [int((h >= 0).sum()) for h in H]}


def evaluate(
    model, head, prompts, new_tokens: int, stop_ids, batch: int = 8, max_nodes: int = 64, top_k: int = 8
) -> Dict[str, dict]:
    """Mean accepted length of EAGLE chain and dynamic-tree decoding at temperature 0, and
    whether the outputs equal plain greedy decoding (``evaluate_drafters``)."""
    drafters = {}
    for name, tree in (("eagle", False), ("eagle-tree", True)):
        d = EagleDrafter(model, head, tree=tree, max_nodes=max_nodes, top_k=top_k)
        drafters[name] = (d, d.max_depth)
    return evaluate_drafters(model, prompts, new_tokens, stop_ids, drafters, batch)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {PROG_MODULE}", description=__doc__.split("\n\n")[0])
    _add_head_arguments(p)
    add_training_arguments(p, steps=2000)
    add_data_arguments(p)
    args = p.parse_args(argv)
    check_training_arguments(p, args)
    check_data_arguments(p, args)
    flags_at_least(p, args, ("segments", "segment", "unroll", "intermediate_size"), 1)
    flags_at_least(p, args, ("reg", "draft_vocab", "hass_top_k", "hass_weight"), 0)
    try:
        args.feature_layers = [int(x) for x in comma_list(args.feature_layers)]
    except ValueError:
        p.error(f"--feature-layers must be comma-separated layer indices, got {args.feature_layers!r}")
    try:
        layer_indices("--feature-layers", args.feature_layers)
    except ValueError as e:
        p.error(str(e))
    if args.draft_vocab_only and args.feature_layers:
        p.error("--draft-vocab-only trains nothing: leave out --feature-layers")
    if args.record_layers and not args.feature_layers and args.init is None:
        p.error("--record-layers records the --feature-layers outputs: name them")
    if args.draft_vocab_only and not Path(args.out).is_file():
        p.error(f"--draft-vocab-only: no head at --out {args.out}")
    if args.init is not None:
        _check_init(p, args)
    return args


def _add_head_arguments(p: argparse.ArgumentParser) -> None:
    """The command line's options of the head and its training (beside the shared ones)."""
    p.add_argument("--segments", type=int, default=8, help="segments per minibatch")
    p.add_argument(
        "--segment", type=int, default=128, help="consecutive positions per segment (= the drafter's window)"
    )
    p.add_argument("--unroll", type=int, default=3, help="training-time test steps (1: teacher forcing only)")
    p.add_argument("--intermediate-size", type=int, default=None, help="the MLP's width (default: the target's)")
    p.add_argument("--reg", type=float, default=0.1, help="weight of the feature regression (smooth L1)")
    p.add_argument(
        "--hass-top-k",
        type=int,
        default=0,
        help="HASS's top-K distillation: also fit the target's K most likely tokens (0: off; HASS used 10)",
    )
    p.add_argument("--hass-weight", type=float, default=1.0, help="weight of the --hass-top-k term")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=DRAFT_VOCAB,
        help="the draft vocabulary the head recommends: the N most frequent training labels (0: the whole vocabulary)",
    )
    p.add_argument(
        "--draft-vocab-only",
        action="store_true",
        help="train nothing: store the training labels' token ranking and --draft-vocab in the head at --out",
    )
    p.add_argument(
        "--feature-layers",
        default="",
        help="comma-separated target layers (0-based) whose outputs the head also reads (EAGLE-3; default none)",
    )
    p.add_argument(
        "--record-layers",
        action="store_true",
        help="record the --feature-layers outputs while generating the data (no second pass over it)",
    )
    p.add_argument("--out", default=str(SHIPPED), help="where the head goes")
    p.add_argument(
        "--init",
        default=None,
        help="start from this head file's weights (fine-tuning; its window must equal --segment)",
    )


def _check_init(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop the command (``p.error``) when the head file of --init cannot be read or does not fit
    the other options: its window, its feature layers, --intermediate-size."""
    try:
        init_config = EagleHead.file_config(args.init)
    except (OSError, ValueError) as e:
        p.error(f"--init: {e}")
    window = init_config["window"]
    if window != args.segment:
        p.error(f"--init: the head's window is {window}, --segment is {args.segment} (they must be equal)")
    init_layers = list(init_config.get("feature_layers", []))
    if init_layers and args.feature_layers and init_layers != args.feature_layers:
        p.error(f"--init: the head reads layers {init_layers}, --feature-layers says {args.feature_layers}")
    if args.intermediate_size is not None:
        p.error("--init: the head's sizes come from its file; leave out --intermediate-size")


def rank_tokens(head: EagleHead, train_rows: FeatureRows, tune_rows: FeatureRows, vocab_size: int, size: int) -> dict:
    """Store the training labels' token ranking in ``head`` with the recommended draft
    vocabulary ``size`` (0: the whole vocabulary) and return the share of the tuning set's
    labels inside it (``coverage``), and the ranking's length."""
    ranking = label_ranking(train_rows.labels, vocab_size)
    head.set_token_ranking(ranking)
    head.config["draft_vocab_size"] = int(size) if 0 < size < vocab_size else None
    vocab = ranking[:size] if 0 < size < vocab_size else torch.arange(vocab_size)
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab] = True
    return {
        "size": int(vocab.numel()),
        "ranked_tokens": int(ranking.numel()),
        "tune_coverage": float(inside[tune_rows.labels].float().mean()),
    }


def check_layers(layers: Sequence[int]):
    """A ``prepare`` check of the target: ``layers`` (--feature-layers) inside it."""

    def check(model: Transformer) -> Optional[str]:
        n = model.args.num_layers
        bad = [i for i in layers if i >= n]
        return f"--feature-layers: the target has {n} layers, no layer {bad[0]}" if bad else None

    return check


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    layers = list(args.feature_layers)
    source = args.out if args.draft_vocab_only else args.init
    if source is not None and not layers:  # the layers the head at --out (--draft-vocab-only) or --init reads
        layers = list(EagleHead.file_config(source).get("feature_layers", []))
    if args.record_layers and not layers:
        print(f"error: --record-layers: the head of --init {args.init} reads no layers", file=sys.stderr)
        return 2
    setup = prepare(args, check_target=check_layers(layers), feature_layers=layers if args.record_layers else ())
    model = setup.model
    train_rows, tune_rows = _training_rows(args, setup, layers)
    t_data = time.perf_counter() - t0
    print(
        f"{train_rows.states.shape[0]} training positions, {tune_rows.states.shape[0]} tuning positions",
        file=sys.stderr,
    )
    if args.draft_vocab_only:
        return _store_draft_vocab(args, argv, model, train_rows, tune_rows)
    head, init_config = _starting_head(args, model, layers)
    t1 = time.perf_counter()
    losses = train_head(
        head,
        model,
        train_rows,
        training_options(args),
        segments=args.segments,
        segment=args.segment,
        unroll=args.unroll,
        reg=args.reg,
        hass_top_k=args.hass_top_k,
        hass_weight=args.hass_weight,
    )
    t_train = time.perf_counter() - t1
    vocab, figures = _tuning_report(args, head, model, train_rows, tune_rows)
    figures["seconds"] = {"data": round(t_data), "training": round(t_train)}
    record = {**training_record(PROG_MODULE, argv, args), "feature_layers": list(head.feature_layers)}
    head.config = {
        **setup.trained_config(record, train_rows.states.shape[0], losses, figures),
        "draft_vocab_size": head.config["draft_vocab_size"],
        "draft_vocab": vocab,
    }
    if args.init is not None:  # the provenance of the weights it started from
        head.config["training"]["init"] = {
            "file": str(args.init),
            "sha256": hashlib.sha256(Path(args.init).read_bytes()).hexdigest(),
            "training": init_config.get("training"),
        }
    return setup.save_and_evaluate(head, EagleHead.load, evaluate, args, (t_data, t_train))


def _training_rows(args: argparse.Namespace, setup, layers: List[int]):
    """``main``'s (training, tuning) ``FeatureRows`` of the prepared data, with the outputs of the
    feature ``layers``: recorded with the data (--record-layers), else one teacher-forced pass over
    it (cached) in the numerics the data was generated in."""
    model = setup.model
    cache = None if args.random_model else default_cache_dir(args.cache_dir)
    separate = layers and not args.record_layers
    with model.numerics_as(args.gen_numerics):
        outputs = [layer_outputs(model, d, layers, cache) if separate else None for d in (setup.train, setup.tune)]
    train_rows = feature_rows(setup.train, model.output.weight, layer_outputs=outputs[0])
    tune_rows = feature_rows(setup.tune, model.output.weight, layer_outputs=outputs[1])
    return train_rows, tune_rows


def _store_draft_vocab(args, argv, model: Transformer, train_rows: FeatureRows, tune_rows: FeatureRows) -> int:
    """--draft-vocab-only: store the training labels' token ranking and the recommended draft
    vocabulary (with its tuning-set agreement) in the head at --out, its weights untouched."""
    head = EagleHead.load(args.out)
    vocab = rank_tokens(head, train_rows, tune_rows, model.args.vocab_size, args.draft_vocab)
    report = agreement(head, model, tune_rows, args.unroll, args.segment, head.recommended_draft_vocab)
    head.config["draft_vocab"] = {
        **vocab,
        "command": training_record(PROG_MODULE, argv, args)["command"],
        "tune_top1": report["top1"],
    }
    head.save(args.out)
    print(
        f"draft vocabulary {vocab['size']} tokens: {vocab['tune_coverage']:.4f} of the tuning labels; top-1 agreement by "
        f"depth {[round(a, 3) for a in report['top1']]}; saved {args.out}",
        file=sys.stderr,
    )
    return 0


def _starting_head(args: argparse.Namespace, model: Transformer, layers: List[int]):
    """The head training starts from, and the config of the --init head it was read from ({}
    for a fresh head): --init's (reading the feature ``layers`` too), else a fresh one."""
    init_config: dict = {}
    if args.init is not None:
        head = EagleHead.for_target(args.init, model)  # its hidden size checked against the target's
        init_config = dict(head.config)
        if layers and not head.feature_layers:  # EAGLE-3 features on an EAGLE head: fuse = [I 0 ...]
            head = head.with_feature_layers(layers)
    else:
        head = EagleHead.for_model(
            model, window=args.segment, intermediate_size=args.intermediate_size, feature_layers=layers
        )
    return head, init_config


def _tuning_report(args, head: EagleHead, model: Transformer, train_rows: FeatureRows, tune_rows: FeatureRows):
    """After training: the head's draft vocabulary (``rank_tokens``, with its top-1 agreement) and
    the tuning set's figures (top-1 agreement by depth, positions, a chain's expected accepted
    length), printed."""
    vocab = rank_tokens(head, train_rows, tune_rows, model.args.vocab_size, args.draft_vocab)
    report = agreement(head, model, tune_rows, args.unroll, args.segment)
    ids = head.recommended_draft_vocab
    if ids is not None:
        vocab["tune_top1"] = agreement(head, model, tune_rows, args.unroll, args.segment, ids)["top1"]
    print(
        f"tuning set: top-1 agreement by depth {[round(a, 3) for a in report['top1']]}; expected accepted length of a "
        f"{args.unroll}-token chain {report['chain_expected_accepted_length']:.2f}",
        file=sys.stderr,
    )
    figures = {
        "tune_top1": report["top1"],
        "tune_positions": report["positions"],
        "tune_chain_expected_accepted_length": report["chain_expected_accepted_length"],
    }
    return vocab, figures


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
