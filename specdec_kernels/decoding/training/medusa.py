"""Train Medusa heads by self-distillation on CPU (Cai et al. 2024, Medusa, self-distillation).

    python -m specdec_kernels.decoding.training.medusa [--heads 4] [--steps N] [--out PATH] [--seed S]

1. Data.  Spec-Bench prompts (``specdec_kernels/data/spec_bench/question.jsonl``) through
   the chat template.  The first 4 questions of every category (in file order) are never
   trained on: ``bench.e2e`` evaluates the first 2 of each category (question_ids 81, 82 for
   writing, ...), and the 3rd and 4th of each category are the *tuning* set on which the
   tree is chosen.  Training uses up to ``--per-category`` (76, i.e. all) of the remaining
   questions of each category (first turns, file order; ``--long-per-category`` (also 76)
   for summarization and rag, whose prompts of ~800 tokens cost the most to prefill: lower
   it for a quicker run): 428 prompts with the defaults.  The target continues every
   prompt with ``--new-tokens`` (384) tokens of its own greedy text (batched plain decoding
   with the engine, batches of similar prompt lengths; about 50 minutes on 2 CPU cores,
   230k training positions).  A recording drafter keeps the target's final hidden state of
   every position: the prompt's (a forward hook on the last decoder layer during the
   engine's prefill) and each step's root (handed over in ``StepResult.features`` by the
   engine's ``observe``, exactly as ``MedusaDrafter`` gets them).  Token ids and hidden states (fp16) are
   cached under ``--cache-dir`` (finished batches too, so an interrupted run resumes).
2. Labels are the target's own predictions: head i at position t learns the token at
   t + i + 2 of the greedy text (the target's argmax given the text before it), and inside
   the prompt the target's argmax at t + i + 1 (``--no-prompt-positions`` trains on the
   generated part only).  Token-conditioned heads (the default; ``--no-token-conditioned``
   trains plain Medusa heads) also read the path tokens by teacher forcing: the text's
   tokens at t + 1 .. t + k through the target's frozen input embedding (past the prompt
   these are exactly the draft path that must be accepted).  Soft labels too
   (``--distill``, default 1: only them): the target's whole distribution over the label,
   its output head on the cached hidden state one position earlier.  With
   ``--context-window`` W (default 32; 0: none) the heads start from a causal attention
   layer over the target's hidden states of the last W positions and the tokens that
   followed them (Hydra++'s prefix attention, ``MedusaHeads.contextualize``), trained with
   the heads on minibatches of ``--batch / --segment`` runs of ``--segment`` (16)
   consecutive positions, so that a run shares its window's rows.  Only the heads train
   (the target, its embedding and its output head are frozen), on the cached hidden states.
   Loss: cross-entropy through the frozen output head, as a sampled softmax (the
   ``--frequent`` most frequent labels, the batch's labels and ``--negatives`` uniformly
   drawn tokens with the usual correction: the full 49152-way softmax costs about 5 s a
   step on this CPU), bfloat16 logits, AdamW, cosine decay,
   minibatches of ``--batch`` positions drawn with ``--seed``.
3. Tree.  On the tuning set's cached hidden states, every position gives the rank of the
   true token in each head's ranking; a node (r_1..r_d) is accepted exactly when the true
   ranks start with r_1..r_d.  The ``--tree-nodes`` most frequent rank prefixes (a
   prefix-closed set, since a prefix is at least as frequent) form the tree that maximises the
   expected accepted length on that set; it is stored with the weights as ``tree_choices``.
   64 nodes by default, the size of Medusa's own tree for Vicuna-7B (63 choices and the
   root); token-conditioned heads rank each node's children along its own path, so the
   ranks are those of the true path (``true_ranks`` by teacher forcing).
4. ``--evaluate`` decodes the held-out bench prompts (the first 2 of each category) with the
   engine at temperature 0, chain and tree, and prints the mean accepted length.

The shipped ``specdec_kernels/data/medusa/smollm2-135m-instruct.pt`` was made with

    python -m specdec_kernels.decoding.training.medusa --seed 0   (all other options default)

(the file's ``config["training"]`` records every option).  Hidden states come from float32
CPU matmuls; another BLAS or thread count may change their last bits, and with them the
trained weights slightly, but not the recipe.

``--random-model`` trains on a tiny random-weight Llama with random prompts instead (a smoke
test of the whole pipeline, in seconds).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from specdec_kernels.decoding.drafters.medusa import (
    SHIPPED,
    MedusaDrafter,
    MedusaHeads,
)
from specdec_kernels.decoding.training.data import (  # noqa: F401  (HiddenRecorder, SelfDistilled...: part of this trainer's API)
    BENCH_PER_CATEGORY,
    HELD_OUT_PER_CATEGORY,
    HiddenRecorder,
    SelfDistilled,
    add_data_arguments,
    add_training_arguments,
    cache_path,
    cached_data,
    chat_ids,
    check_data_arguments,
    check_training_arguments,
    default_cache_dir,
    evaluate_drafters,
    flags_at_least,
    generate_data,
    length_batches,
    load_target,
    prepare,
    print_evaluation,
    self_distilled_sets,
    split_questions,
    tiny_random_model,
    training_options,
    training_record,
)
from specdec_kernels.decoding.training.softmax import (
    TrainingOptions,
    candidate_logits,
    hard_and_soft_losses,
)

PROG_MODULE = "specdec_kernels.decoding.training.medusa"


class Examples(NamedTuple):
    """Training examples (see ``examples``).

    hidden: (M, hidden) fp16, the target's final hidden state h_t at each example's position t.
    labels: (M, k) int64, labels[:, i] the target's prediction of the token at t + i + 2 (-100: none).
    path: (M, k) int64, path[:, i] the text's token at t + i + 1 (path[:, 0] the root).
    teacher: (M, k) int64, teacher[:, i] the row of ``states`` holding h_{t+i+1}, whose
        output-head distribution is the target's own distribution over the token at
        t + i + 2 (the soft label of head i); -1 where labels[:, i] is -100 and for a
        sequence's last label (the hidden state of its last fed token is not recorded).
    states: (N, hidden) fp16, every recorded hidden state of the data (sequence after
        sequence, consecutive positions).
    rows: (M,) int64, the row of ``states`` holding each example's h_t (hidden == states[rows]).
    next_tokens: (N,) int64, the text's token after each row's position (what the context
        layer reads with that row, ``MedusaHeads.contextualize``).
    seq_start: (N,) int64, the first row of each row's sequence.
    """

    hidden: torch.Tensor
    labels: torch.Tensor
    path: torch.Tensor
    teacher: torch.Tensor
    states: torch.Tensor
    rows: torch.Tensor
    next_tokens: torch.Tensor
    seq_start: torch.Tensor


def examples(
    data: SelfDistilled,
    num_heads: int,
    prompt: bool = True,
    output_weight: Optional[torch.Tensor] = None,
    chunk: int = 2048,
) -> Examples:
    """Training examples (``Examples``): hidden states X (M, hidden) fp16 at positions t;
    labels Y (M, k) int64: Y[:, i] is the target's prediction of the token at t + i + 2
    (-100 where the text ends first); the path tokens T (M, k) int64: T[:, i] is the text's
    token at t + i + 1 (T[:, 0] the root; what token-conditioned heads read, by teacher
    forcing; the last token where the text ends first); and where the target's own
    distribution over each label lies (``teacher`` rows of ``states``), for distillation.

    Past the prompt the text is the target's greedy output, so the label is the token there.
    Inside the prompt (``prompt`` True) the label is the target's own argmax at t + i + 1
    (from the cached hidden state there, through ``output_weight``), not the prompt's text:
    self-distillation throughout.  ``prompt`` False keeps only the positions the drafter
    sees while decoding, from the prompt's second-to-last token on.
    """
    xs, ys, ts, teach, where, nexts, starts = [], [], [], [], [], [], []
    offset = 0  # of data.hidden[s] in the concatenated states
    W_out = None if output_weight is None else output_weight.detach().float()
    for s, toks in enumerate(data.tokens):
        h = data.hidden[s]
        first, P = data.first[s], data.prompt_lengths[s]
        start, rows = offset, h.shape[0]
        offset += rows
        nexts.append(torch.tensor(toks[first + 1 : first + 1 + rows], dtype=torch.int64))
        starts.append(torch.full((rows,), start, dtype=torch.int64))
        skip = 0
        if not prompt:
            skip = max(0, P - 2 - first)
            h, first = h[skip:], first + skip
        T = h.shape[0]
        if T == 0:
            continue
        seq = _distilled_tokens(toks, h, first, P, W_out, chunk)
        rows_at = _StateRows(start, data.first[s], rows)
        lab, path, tea = _head_targets(toks, seq, first + torch.arange(T), num_heads, rows_at)
        keep = lab[:, 0] >= 0
        xs.append(h[keep])
        ys.append(lab[keep])
        ts.append(path[keep])
        teach.append(tea[keep])
        where.append(start + skip + keep.nonzero()[:, 0])
    states = torch.cat(list(data.hidden)) if data.hidden else torch.zeros(0, 0, dtype=torch.float16)
    return Examples(
        torch.cat(xs),
        torch.cat(ys),
        torch.cat(ts),
        torch.cat(teach),
        states,
        torch.cat(where),
        torch.cat(nexts),
        torch.cat(starts),
    )


def _distilled_tokens(
    toks: List[int], h: torch.Tensor, first: int, P: int, W_out: Optional[torch.Tensor], chunk: int
) -> torch.Tensor:
    """The sequence's tokens (int64) as ``examples``' labels: the text, but where a row of ``h``
    (positions ``first`` on) predicts a prompt token (of the P), the target's argmax there through
    W_out, computed ``chunk`` rows at a time.

    Raises:
        ValueError: W_out None while such rows exist.
    """
    seq = torch.tensor(toks, dtype=torch.int64)
    # rows 1..n-1 (positions first+1..P-2) predict prompt tokens that serve as labels
    # (positions >= first + 2): replace those tokens by the target's argmax
    n_prompt = max(0, min(h.shape[0], P - 1 - first))
    if n_prompt > 1:
        if W_out is None:
            raise ValueError("examples over prompt positions need output_weight (the target's head)")
        pred = torch.cat(
            [(h[j : min(j + chunk, n_prompt)].float() @ W_out.T).argmax(-1) for j in range(1, n_prompt, chunk)]
        )
        seq[first + 2 : first + 1 + n_prompt] = pred
    return seq


class _StateRows(NamedTuple):
    """Where a sequence's recorded hidden states lie in ``Examples.states``: from row ``start`` on,
    ``rows`` of them, of the positions ``first`` on."""

    start: int
    first: int
    rows: int


def _head_targets(toks: List[int], seq: torch.Tensor, pos: torch.Tensor, num_heads: int, rows_at: _StateRows):
    """For the positions ``pos`` (T,) of one sequence: the labels (T, k) from ``seq`` (-100 past the
    text), the path tokens (T, k) from the text ``toks`` and the teacher rows (T, k) of
    ``Examples.states`` (-1: none; see ``Examples``)."""
    T = pos.shape[0]
    lab = torch.full((T, num_heads), -100, dtype=torch.int64)
    path = torch.empty((T, num_heads), dtype=torch.int64)
    text = torch.tensor(toks, dtype=torch.int64)  # the inputs are the text, the labels the target's predictions
    tea = torch.full((T, num_heads), -1, dtype=torch.int64)
    for i in range(num_heads):
        target = pos + i + 2
        ok = target < len(toks)
        lab[ok, i] = seq[target[ok]]
        path[:, i] = text[(pos + i + 1).clamp(max=len(toks) - 1)]
        row = pos + i + 1 - rows_at.first  # h_{t+i+1} in this sequence's states
        has = ok & (row < rows_at.rows)
        tea[has, i] = rows_at.start + row[has]
    return lab, path, tea


def context_batch(
    heads: MedusaHeads, embedding: torch.Tensor, ex: Examples, query_rows: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """s_0 from the context layer (``MedusaHeads.contextualize``) for segments of
    consecutive positions.

    Args:
        query_rows: (S, L) int64 rows of ``ex.states``; segment s holds the positions
            query_rows[s, 0] + 0..L-1 as far as its rows run on consecutively.
        embedding: the target's input embedding (vocab, hidden).

    Returns:
        (S, L, hidden) s_0 in the heads' dtype, and (S, L) bool: the queries that continue
        their segment's first row in its sequence (the others are meaningless).  Each valid
        query sees the rows of its own sequence within the window, as the drafter does
        while decoding.
    """
    S, L = query_rows.shape
    W, N = heads.context_window, ex.states.shape[0]
    first = query_rows[:, :1]
    seq = ex.seq_start[first.clamp(max=N - 1)]
    # consecutive rows of the first query's own sequence (rows run on into the next sequence
    # when its first position is an example); once broken, a run stays broken
    continues = (query_rows == first + torch.arange(L)) & (ex.seq_start[query_rows.clamp(max=N - 1)] == seq)
    continues = continues.cumprod(dim=1).bool()
    keys = (
        first - (W - 1) + torch.arange(W - 1 + L)
    )  # (S, W - 1 + L): the window before the first query, then the queries
    valid = (keys >= seq) & (keys < N)
    keys = keys.clamp(0, N - 1)
    valid &= ex.seq_start[keys] == seq
    hidden = ex.states[keys].float()
    nxt = embedding[ex.next_tokens[keys]].float()
    return heads.contextualize(hidden, nxt, valid, num_queries=L), continues


def run_starts(ex: Examples) -> torch.Tensor:
    """(M,) bool: the examples that do not continue the one before them (a gap in the rows,
    or another sequence)."""
    rows = ex.rows
    brk = torch.ones(rows.shape[0], dtype=torch.bool)
    brk[1:] = (rows[1:] != rows[:-1] + 1) | (ex.seq_start[rows[1:]] != ex.seq_start[rows[:-1]])
    return brk


@torch.no_grad()
def context_states(
    heads: MedusaHeads, embedding: torch.Tensor, ex: Examples, segment: int = 64, chunk: int = 64
) -> torch.Tensor:
    """(M, hidden) float32: s_0 of every example of ``ex`` through the context layer (the
    examples' h_t when the heads have none)."""
    if not heads.context_window:
        return ex.hidden.float()
    rows = ex.rows
    M = rows.shape[0]
    runs = run_starts(ex).nonzero()[:, 0].tolist()
    starts = []
    for run, end in zip(runs, runs[1:] + [M]):
        starts += list(range(run, end, segment))
    lens = [min(segment, e - s) for s, e in zip(starts, starts[1:] + [M])]
    out = torch.empty(M, heads.hidden_size)
    E = embedding.detach()
    ar = torch.arange(segment)
    for c in range(0, len(starts), chunk):
        st = torch.tensor(starts[c : c + chunk])
        z, _ = context_batch(heads, E, ex, rows[st][:, None] + ar)
        for j, (s0, n) in enumerate(zip(starts[c : c + chunk], lens[c : c + chunk])):
            out[s0 : s0 + n] = z[j, :n].float()
    return out


# ---------------------------------------------------------------------- training
def train_heads(
    heads: MedusaHeads,
    output_weight: torch.Tensor,
    X: torch.Tensor,
    Y: torch.Tensor,
    options: TrainingOptions,
    *,
    batch: int,
    tokens: Optional[torch.Tensor] = None,
    embedding: Optional[torch.Tensor] = None,
    teacher: Optional[torch.Tensor] = None,
    teacher_states: Optional[torch.Tensor] = None,
    context: Optional[Examples] = None,
    segment: int = 16,
) -> List[float]:
    """Cross-entropy of every head against its labels through the frozen output head, with a sampled softmax (the
    full 49152-token softmax costs too much on a CPU): the loss of every step.

    Each step's softmax runs over the ``options.frequent`` most frequent labels of the data, the batch's other labels,
    and ``options.negatives`` tokens drawn uniformly from the rest of the vocabulary whose logits get
    + log(rest / negatives) (the mass of the tokens not drawn, as in sampled softmax, Jean et al. 2015); with a
    vocabulary that small, the full softmax.  The logits are computed in bfloat16.  AdamW with linear warm-up (5 % of
    the steps) and cosine decay (``options``: steps, lr, weight_decay); minibatches and negatives drawn from
    ``options.seed``.

    With ``options.distill`` > 0 the loss is (1 - distill) x that cross-entropy + distill x the cross-entropy against
    the target's own distribution over the same candidate tokens (soft labels: the output head applied to h_{t+i+1},
    the ``teacher`` rows of ``teacher_states``), as in Medusa-2's self-distillation and Hydra's teacher distillation:
    the whole distribution is a richer signal than its argmax.

    Args:
        X: (M, hidden) hidden states; Y: (M, k) labels (-100 ignored); batch: positions per minibatch.
        options: the optimiser's schedule, the sampled softmax and ``distill``, the weight of the soft-label term
            (``TrainingOptions``).
        tokens, embedding: token-conditioned heads only: the path tokens T (M, k) from ``examples`` and the target's
            input embedding (vocab, hidden), frozen.
        teacher, teacher_states: for distill > 0: ``Examples.teacher`` (M, k) and ``Examples.states`` (N, hidden).
        context: heads with a context layer only: the ``Examples`` that X and Y come from (X is then only counted:
            s_0 comes from their states, rows, next tokens and sequence starts); each minibatch is batch // segment
            runs of ``segment`` (at most batch) consecutive examples of one sequence, whose s_0 comes from the
            context layer (``context_batch``), trained together with the heads.

    Raises:
        ValueError: token-conditioned heads without tokens and embedding; distill > 0 without teacher and
            teacher_states; heads with a context layer without context or embedding; segment < 1; shapes that do
            not match.
    """
    run = _HeadsTraining(
        heads, X, Y, options.distill, batch, tokens, embedding, teacher, teacher_states, context, segment
    )
    g = options.generator()
    softmax, W_bf = options.softmax(output_weight, Y)
    heads.train()
    optimiser = options.optimiser(heads.parameters())
    for _ in optimiser.run(options.desc):
        idx, s0, y = run.minibatch(g)
        c = softmax.draw(y, g)
        optimiser.step(run.loss(idx, s0, y, c, W_bf))
    heads.eval()
    return optimiser.losses


@dataclass
class _HeadsTraining:
    """``train_heads``' inputs (its arguments, ``distill`` from its options), checked, and its
    minibatches and their loss.

    Raises:
        ValueError: as ``train_heads``.
    """

    heads: MedusaHeads
    X: torch.Tensor
    Y: torch.Tensor
    distill: float
    batch: int
    tokens: Optional[torch.Tensor]
    embedding: Optional[torch.Tensor]
    teacher: Optional[torch.Tensor]
    teacher_states: Optional[torch.Tensor]
    context: Optional[Examples]
    segment: int

    def __post_init__(self) -> None:
        self._check()
        self.E = None if self.embedding is None else self.embedding.detach().float()
        if self.heads.context_window:
            self.L = min(self.segment, self.batch)
            brk = run_starts(self.context)
            self.run_first = torch.cummax(
                torch.where(brk, torch.arange(brk.numel()), 0), dim=0
            ).values  # each example's run's first

    def _check(self) -> None:
        heads, X, Y, tokens, teacher, context = self.heads, self.X, self.Y, self.tokens, self.teacher, self.context
        if heads.token_conditioned and (tokens is None or self.embedding is None):
            raise ValueError("token-conditioned heads train on tokens (the path tokens) and embedding (the target's)")
        if self.distill > 0 and (teacher is None or self.teacher_states is None):
            raise ValueError("distill > 0 needs teacher and teacher_states (from examples())")
        if heads.context_window and context is None:
            raise ValueError("heads with a context layer train on context (the Examples of X and Y)")
        if self.segment < 1:
            raise ValueError(f"segment must be >= 1, got {self.segment}")
        if context is not None and context.rows.shape[0] != X.shape[0]:
            raise ValueError(f"context must be the Examples of X ({X.shape[0]} rows), got {context.rows.shape[0]}")
        if X.ndim != 2 or Y.ndim != 2 or Y.shape[0] != X.shape[0] or Y.shape[1] != heads.num_heads:
            raise ValueError(
                f"X must be (M, hidden) and Y (M, {heads.num_heads}), got {tuple(X.shape)} and {tuple(Y.shape)}"
            )
        if heads.token_conditioned and tokens.shape != Y.shape:
            raise ValueError(f"tokens must have Y's shape {tuple(Y.shape)}, got {tuple(tokens.shape)}")
        if self.distill > 0:
            if teacher.shape != Y.shape:
                raise ValueError(f"teacher must have Y's shape {tuple(Y.shape)}, got {tuple(teacher.shape)}")
            if teacher.numel() and int(teacher.max()) >= self.teacher_states.shape[0]:
                raise ValueError(f"teacher rows must lie below teacher_states' {self.teacher_states.shape[0]} rows")
        if heads.context_window and self.embedding is None:
            raise ValueError("heads with a context layer need embedding (the target's input embedding)")

    def minibatch(self, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A minibatch drawn with ``g``: its examples' indices (n,), s_0 (n, hidden) and labels (n, k)."""
        X, Y = self.X, self.Y
        if not self.heads.context_window:
            idx = torch.randint(0, X.shape[0], (self.batch,), generator=g)
            return idx, X[idx].float(), Y[idx]
        # a run of L examples starts up to L - 1 before a uniformly drawn one (not
        # before its run's first), so that a run's first examples are drawn too
        L = self.L
        m = torch.randint(0, X.shape[0], (self.batch // L,), generator=g)
        back = torch.randint(0, L, (self.batch // L,), generator=g)
        first = torch.maximum(self.run_first[m], m - back)
        seg = (first[:, None] + torch.arange(L)).clamp(max=X.shape[0] - 1)
        s0, continues = context_batch(self.heads, self.E, self.context, self.context.rows[seg])
        idx, s0 = seg.reshape(-1), s0.reshape(-1, s0.shape[-1])
        return idx, s0, torch.where(continues.reshape(-1, 1), Y[idx], -100)

    def loss(self, idx, s0, y, c, W_bf) -> torch.Tensor:
        """The minibatch's loss over the sampled softmax's candidates ``c`` (W_bf: the output head, bfloat16)."""
        distill = self.distill
        target = c.targets(y)
        emb = self.E[self.tokens[idx]] if self.heads.token_conditioned else None
        states = self.heads(s0, embeddings=emb)  # (batch, k, hidden)
        W_c = W_bf[c.tokens].T
        logits = candidate_logits(states, W_c, c.bias)
        if distill > 0:
            # per label: (1 - distill) hard + distill soft; hard alone where the target's
            # distribution was not recorded (a sequence's last label)
            ti = self.teacher[idx]
            hard, soft, _ = hard_and_soft_losses(logits, target, self.teacher_states[ti.clamp(min=0)], W_c, c.bias)
            per = torch.where(ti >= 0, (1 - distill) * hard + distill * soft, hard)
            valid = target >= 0
            return (per * valid).sum() / valid.sum().clamp(min=1)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


@torch.no_grad()
def true_ranks(
    heads: MedusaHeads,
    output_weight: torch.Tensor,
    X: torch.Tensor,
    Y: torch.Tensor,
    chunk: int = 512,
    tokens: Optional[torch.Tensor] = None,
    embedding: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(M, k) int64: the rank of each label in its head's ranking (0 = argmax), -1 where
    the label is missing.  Token-conditioned heads read the true path (``tokens``, through
    ``embedding``): the ranking a tree node sees when the path to it is the right one."""
    W_out = output_weight.detach().float()
    E = embedding.detach().float() if heads.token_conditioned else None
    out = []
    for s in range(0, X.shape[0], chunk):
        emb = E[tokens[s : s + chunk]] if heads.token_conditioned else None
        logits = heads(X[s : s + chunk].float(), embeddings=emb) @ W_out.T  # (m, k, V)
        y = Y[s : s + chunk]
        lab = logits.gather(-1, y.clamp(min=0)[..., None])
        r = (logits > lab).sum(-1)
        out.append(torch.where(y >= 0, r, -1))
    return torch.cat(out)


def best_tree(ranks: torch.Tensor, max_nodes: int, max_rank: int = 10) -> Tuple[List[Tuple[int, ...]], float]:
    """The token tree of at most ``max_nodes`` nodes (root included) that maximises the
    expected accepted length on these positions, and that expectation (bonus included).

    ranks: (M, k) from ``true_ranks``.  Node (r_1..r_d) is accepted at a position when the
    true ranks there start with r_1..r_d; the expected accepted length of a tree is 1 plus
    the sum of its nodes' frequencies, and the most frequent prefixes form a subtree.
    """
    counts: Counter = Counter()
    M, k = ranks.shape
    for row in ranks.tolist():
        prefix: Tuple[int, ...] = ()
        for r in row:
            if r < 0 or r >= max_rank:
                break
            prefix = prefix + (r,)
            counts[prefix] += 1
    # frequency first, then shorter, then lexicographic: a prefix always precedes its extensions
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))
    chosen = [p for p, _ in ranked[: max(0, max_nodes - 1)]]
    expected = 1.0 + sum(counts[p] for p in chosen) / max(M, 1)
    return sorted(chosen, key=lambda p: (len(p), p)), expected


# ---------------------------------------------------------------------- evaluation
def evaluate(model, heads, prompts, new_tokens: int, stop_ids, tree_choices=None, batch: int = 8) -> Dict[str, dict]:
    """Mean accepted length of Medusa chain and tree decoding at temperature 0 on the prompts,
    and whether the outputs equal plain greedy decoding (``evaluate_drafters``)."""
    drafters = {
        name: (MedusaDrafter(model, heads, tree=tree, choices=tree_choices if tree else None), heads.num_heads)
        for name, tree in (("medusa", False), ("medusa-tree", True))
    }
    return evaluate_drafters(model, prompts, new_tokens, stop_ids, drafters, batch)


# ---------------------------------------------------------------------- CLI
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {PROG_MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=4, help="number of Medusa heads (draft depth)")
    p.add_argument(
        "--token-conditioned",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="heads that also read the draft path's tokens (Hydra); --no-token-conditioned: plain Medusa heads",
    )
    p.add_argument(
        "--context-window",
        type=int,
        default=32,
        help="positions the heads' context attention layer sees (Hydra++ prefix attention); 0: none",
    )
    p.add_argument(
        "--context-heads",
        type=int,
        default=None,
        help="attention heads of the context layer (head dimension 64; default hidden / 64)",
    )
    p.add_argument(
        "--segment", type=int, default=16, help="consecutive positions per minibatch run (context layer only)"
    )
    p.add_argument("--batch", type=int, default=256, help="positions per minibatch")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument(
        "--prompt-positions",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train on prompt positions (labels: the target's argmax there)",
    )
    p.add_argument("--tree-nodes", type=int, default=64, help="nodes of the tuned tree, root included")
    p.add_argument("--out", default=str(SHIPPED), help="where the heads go")
    add_training_arguments(p, steps=4000)
    add_data_arguments(p)
    args = p.parse_args(argv)
    check_training_arguments(p, args, weight_decay=args.weight_decay)
    flags_at_least(p, args, ["context_window"], 0)
    flags_at_least(p, args, ("context_heads", "heads", "segment", "batch", "tree_nodes"), 1)
    check_data_arguments(p, args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    setup = prepare(args)
    model = setup.model
    t_data = time.perf_counter() - t0

    ex = examples(setup.train, args.heads, prompt=args.prompt_positions, output_weight=model.output.weight)
    tune = examples(setup.tune, args.heads, prompt=False)
    X, Y = ex.hidden, ex.labels
    print(f"{X.shape[0]} training positions, {tune.hidden.shape[0]} tuning positions", file=sys.stderr)
    heads = MedusaHeads(
        model.args.hidden_size,
        args.heads,
        token_conditioned=args.token_conditioned,
        context_window=args.context_window,
        context_heads=args.context_heads,
    )
    E = model.tok_embeddings.weight
    t1 = time.perf_counter()
    losses = train_heads(
        heads,
        model.output.weight,
        X,
        Y,
        training_options(args, weight_decay=args.weight_decay),
        batch=args.batch,
        tokens=ex.path,
        embedding=E,
        teacher=ex.teacher,
        teacher_states=ex.states,
        context=ex if args.context_window else None,
        segment=args.segment,
    )
    t_train = time.perf_counter() - t1

    ranks = true_ranks(
        heads, model.output.weight, context_states(heads, E, tune), tune.labels, tokens=tune.path, embedding=E
    )
    top1 = [(ranks[:, i] == 0).float()[ranks[:, i] >= 0].mean().item() for i in range(args.heads)]
    choices, expected = best_tree(ranks, args.tree_nodes)
    chain_expected = 1.0 + sum((ranks[:, : i + 1] == 0).all(dim=1).float().mean().item() for i in range(args.heads))
    print(
        f"tuning set: top-1 accuracy by head {[round(a, 3) for a in top1]}; expected accepted length "
        f"chain {chain_expected:.2f}, tree ({len(choices) + 1} nodes) {expected:.2f}",
        file=sys.stderr,
    )

    figures = {"tune_top1": top1, "tune_expected_accepted_length": {"chain": chain_expected, "tree": expected}}
    heads.config = {
        **setup.trained_config(training_record(PROG_MODULE, argv, args), X.shape[0], losses, figures),
        "tree_choices": [list(c) for c in choices],
    }
    return setup.save_and_evaluate(heads, MedusaHeads.load, evaluate, args, (t_data, t_train))


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
