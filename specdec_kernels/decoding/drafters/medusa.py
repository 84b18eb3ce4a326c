"""Medusa heads: draft tokens from the target's own last hidden state (Cai et al. 2024,
"Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads").

Head i (0-based) maps the target's final hidden state h_t (after its final norm: the
input of the output head) at position t to a distribution over the token at t + i + 2:

    logits_i = W_out (h_t + SiLU(W_i h_t))

with W_i (hidden x hidden, zero-initialised, so that a fresh head equals the base head) and
W_out the target's frozen output head, shared rather than copied, so that each head adds
only hidden^2 weights (SmolLM2-135M: 576^2, 0.66 MB in fp16).  The target itself predicts
t + 1 (the bonus token, the next root), head 0 the first draft below that root, head 1 the
second, and so on: no extra target pass and no draft model.

Token-conditioned heads (``token_conditioned=True``; sequentially dependent draft heads as
in Hydra, Ankner et al. 2024) also read the tokens already on the draft path: with
s_0 = h_t and x_{t+1} the root,

    s_{i+1} = s_i + SiLU(W_i s_i + U_i E[x_{t+i+1}] + b_i),    logits_i = W_out s_{i+1}

where E is the target's (frozen, shared) input embedding.  Head 0 then knows the root, head
1 the root and the first draft token below it, and so on; a tree drafts each node's
children from the state of the path to that node (one head step per expanded node).  This
doubles the weights (2 hidden^2 + hidden per head) and lifts the accuracy of the deeper
heads the most: SmolLM2-135M, the same 69k self-distilled positions and 2000 steps, top-1
accuracy of heads 1-4 on held-out prompts 0.21 / 0.08 / 0.06 / 0.05 for plain heads,
0.29 / 0.21 / 0.19 / 0.17 token-conditioned.

Heads with a context layer (``context_window`` W > 0; Hydra++'s prefix attention, Ankner
et al. 2024) replace s_0 = h_t by one causal attention layer over the hidden states of the
last W positions and the tokens that followed them (``MedusaHeads.contextualize``): the
heads then see the recent text, not the last position alone.  SmolLM2-135M, 230k
self-distilled positions, 1500 steps: expected accepted length of the 64-node tree on the
tuning prompts 2.08 without, 2.18 with a window of 32.

The engine hands over h_t because the drafter declares ``Drafter.wants_hidden``: each
``observe(result)`` gets ``result.features.last``, after each step the hidden state of the
last accepted node, and after the prefill that of the prompt's second-to-last token (the
node before the first root); for a context layer also every committed position's
(``features.context``: the last W fed prompt positions, then each step's accepted path).  ``MedusaDrafter`` then drafts

* a chain: each head's argmax (depth d from head d - 1);
* a static token tree from Medusa-style choice paths (``specdec_kernels.tree.
  medusa_choices_to_tree``): node (r_1, ..., r_d) is head d - 1's r_d-th best token under
  its parent.  The default tree is the one stored with the weights, chosen on held-out
  prompts (see ``decoding.training.medusa``).

Drafts are deterministic (``Draft.probs`` is None): greedy verification, and lossless
rejection sampling with q one-hot (tree_rejection_sample handles deterministic sibling
sets exactly), keep the target's output exact.

Weights for SmolLM2-135M-Instruct ship in ``specdec_kernels/data/medusa/
smollm2-135m-instruct.pt`` (``load_medusa_heads()``); they were trained by
self-distillation with ``python -m specdec_kernels.decoding.training.medusa`` (the exact
command is in that module's docstring and in the file's ``config["training"]``, which names
the trainer by its former module path ``decoding.train_medusa``: the arguments are the same).

Example::

    model, tok = load_smollm2()
    drafter = MedusaDrafter(model, tree=True)            # shipped heads, stored tree
    decoder = SpeculativeDecoder(model, drafter, stop_token_ids=[tok.eos_token_id])
    result = decoder.generate([ids], max_new_tokens=128, num_draft_tokens=4)
"""

from __future__ import annotations

import math
from bisect import bisect_right
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from specdec_kernels.checks import integer_at_least
from specdec_kernels.decoding.draft import Draft, Drafter, DraftRequest, StepResult, chain_parents, draft_distribution
from specdec_kernels.decoding.drafters.head_file import HeadFile
from specdec_kernels.decoding.engine.adaptive import TreeBudget
from specdec_kernels.decoding.loading import MODEL_NAME
from specdec_kernels.decoding.model import Transformer, linear, rotate
from specdec_kernels.tree import medusa_choices_to_tree

FORMAT = 3  # 1: unconditioned heads only, 2: no context attention (both still read)
READABLE_FORMATS = (1, 2, 3)
KIND = "medusa-heads"  # config["kind"] of the files ``MedusaHeads.save`` writes
CONTEXT_ROPE_THETA = 10000.0
SHIPPED = Path(__file__).resolve().parents[2] / "data" / "medusa" / "smollm2-135m-instruct.pt"
BASE_MODEL = MODEL_NAME

# Fallback tree (27 nodes with the root) for heads stored without a tuned tree: top ranks of
# the first heads, in the spirit of Medusa's sparse trees.
GENERIC_CHOICES = (
    (0,),
    (1,),
    (2,),
    (3,),
    (4,),
    (0, 0),
    (0, 1),
    (0, 2),
    (1, 0),
    (1, 1),
    (2, 0),
    (3, 0),
    (0, 0, 0),
    (0, 0, 1),
    (0, 1, 0),
    (1, 0, 0),
    (0, 0, 2),
    (2, 0, 0),
    (0, 0, 0, 0),
    (0, 0, 0, 1),
    (0, 0, 1, 0),
    (0, 1, 0, 0),
    (1, 0, 0, 0),
    (0, 0, 0, 0, 0),
    (0, 0, 0, 0, 1),
    (0, 0, 0, 0, 0, 0),
)


class MedusaHeads(HeadFile):
    """``num_heads`` residual blocks on the target's final hidden state, read out by the
    target's own (frozen, shared) output head.

    Unconditioned (Medusa): head i gives ``h + SiLU(W_i h)``.  Token-conditioned (Hydra):
    head i gives ``s_{i+1} = s_i + SiLU(W_i s_i + U_i e_i + b_i)`` from s_0 = h, where e_i is
    the target's input embedding of the (i+1)-th token of the draft path (e_0: the root).

    Args:
        hidden_size: the target's hidden size.
        num_heads: k, the most draft tokens per step (head i predicts t + i + 2).
        token_conditioned: the Hydra form above (needs the path's token embeddings).
        context_window: > 0 adds a causal attention layer over the hidden states of the
            last ``context_window`` positions (Hydra++'s prefix attention; see
            ``contextualize``): s_0 is then its output instead of h_t.  0: none.
        context_heads: attention heads of that layer (None: hidden_size // 64, at least 1).
        context_head_dim: their dimension, even (rotary embedding); None: 64, or
            hidden_size rounded down to even when that is smaller.
        config: free-form metadata kept with the weights (base model, fingerprint,
            training command, tuned tree ``tree_choices``).

    Attributes:
        weight: Parameter (num_heads, hidden_size, hidden_size), zero at creation.
        token_weight, bias: Parameters (num_heads, hidden_size, hidden_size) and
            (num_heads, hidden_size), zero at creation; token-conditioned heads only.
        context_qkv, context_out: Parameters (3 A, 2 hidden_size), random (nn.Linear's
            initialisation), and (hidden_size, A), zero at creation (so that fresh heads
            ignore the context), with A = context_heads x context_head_dim; context_window
            > 0 only.

    Raises:
        ValueError: hidden_size < 1, num_heads < 1, context_window < 0, context_heads < 1,
            or an odd or non-positive context_head_dim.
    """

    KIND = KIND
    DESCRIPTION, ARTICLE = "Medusa heads", "a"
    READABLE_FORMATS = READABLE_FORMATS
    SHIPPED = SHIPPED

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 4,
        *,
        token_conditioned: bool = False,
        context_window: int = 0,
        context_heads: Optional[int] = None,
        context_head_dim: Optional[int] = None,
        config: Optional[dict] = None,
    ):
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        integer_at_least("context_window", context_window, 0)
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.token_conditioned = bool(token_conditioned)
        self.context_window = int(context_window)
        self.context_heads = self.context_head_dim = 0
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        if self.token_conditioned:
            self.token_weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
            self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))
        if self.context_window:
            nh = max(1, hidden_size // 64) if context_heads is None else int(context_heads)
            hd = min(64, hidden_size - hidden_size % 2) if context_head_dim is None else int(context_head_dim)
            if nh < 1:
                raise ValueError(f"context_heads must be >= 1, got {context_heads}")
            if hd < 2 or hd % 2:
                raise ValueError(
                    f"context_head_dim must be even and >= 2, got {hd}"
                    + (" (from hidden_size)" if context_head_dim is None else "")
                )
            self.context_heads, self.context_head_dim = nh, hd
            bound = 1.0 / math.sqrt(2 * hidden_size)  # nn.Linear's default initialisation
            self.context_qkv = nn.Parameter(torch.empty(3 * nh * hd, 2 * hidden_size).uniform_(-bound, bound))
            self.context_out = nn.Parameter(torch.zeros(hidden_size, nh * hd))
        self.config: Dict = dict(config or {})
        self.source: Optional[str] = None  # the file it was loaded from (``load``), for messages

    def _num_heads(self, num_heads: Optional[int]) -> int:
        k = self.num_heads if num_heads is None else num_heads
        if not 1 <= k <= self.num_heads:
            raise ValueError(f"num_heads must lie in 1..{self.num_heads}, got {num_heads}")
        return k

    def _check_hidden(self, hidden: torch.Tensor) -> None:
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden must have last dimension {self.hidden_size}, got shape {tuple(hidden.shape)}")

    def contextualize(
        self,
        hidden: torch.Tensor,
        next_embeddings: torch.Tensor,
        valid: Optional[torch.Tensor] = None,
        num_queries: int = 1,
    ) -> torch.Tensor:
        """The context attention layer (``context_window`` > 0): s_0 for the last
        ``num_queries`` of R consecutive positions j (oldest first).

        Position t's query attends to the positions j in (t - context_window, t] (itself
        included) whose rows are valid:

            u_j = [rms(h_j); rms(E[x_{j+1}])],   q, k, v = split(C u),
            s_0(t) = h_t + O attn(rope(q_t), rope(k_j), v_j)

        with rms a weightless RMS norm, E[x_{j+1}] the input embedding of the token that
        followed position j (for t: the root), rotary position embeddings on the row index
        (relative offsets, so any start position gives the same result), C = context_qkv
        and O = context_out.  This is Hydra++'s prefix attention (Ankner et al. 2024): the
        heads see the hidden states of the recent text, not h_t alone.

        Args:
            hidden: Shape (B, R, hidden_size), any float dtype: final hidden states of R
                consecutive positions (after the target's final norm).
            next_embeddings: Shape (B, R, hidden_size): the input embedding of the token at
                each position + 1.
            valid: Shape (B, R) bool, or None (all valid): rows that exist (padding,
                another sequence's rows: False).  A query row must be valid.
            num_queries: Q, the last Q rows are the queries (1 <= Q <= R).

        Returns:
            Shape (B, Q, hidden_size), the weights' dtype.

        Raises:
            ValueError: no context layer, shapes that do not match, Q out of range.
        """
        valid = self._context_inputs(hidden, next_embeddings, valid, num_queries)
        B, R, H = hidden.shape
        dt = self.context_qkv.dtype
        h = hidden.to(dt)
        u = torch.cat([F.rms_norm(h, (H,), eps=1e-6), F.rms_norm(next_embeddings.to(dt), (H,), eps=1e-6)], dim=-1)
        nh, hd, Q = self.context_heads, self.context_head_dim, num_queries
        q, k, v = linear(u, self.context_qkv).split(nh * hd, dim=-1)
        pos = torch.arange(R, device=h.device)
        q = _rope(q[:, R - Q :].reshape(B, Q, nh, hd), pos[R - Q :])
        k = _rope(k.reshape(B, R, nh, hd), pos)
        v = v.reshape(B, R, nh, hd)
        offset = pos[R - Q :, None] - pos[None, :]  # (Q, R): query row - key row
        mask = valid[:, None, :] & (offset >= 0) & (offset < self.context_window)
        mask = mask | (offset == 0)  # a query always sees itself (keeps padded queries finite)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None]
        )
        return h[:, R - Q :] + linear(a.transpose(1, 2).reshape(B, Q, nh * hd), self.context_out)

    def _context_inputs(self, hidden, next_embeddings, valid, num_queries: int) -> torch.Tensor:
        """``contextualize``'s inputs checked (its ValueErrors): the valid rows (B, R) bool, all of
        them when ``valid`` is None."""
        if not self.context_window:
            raise ValueError("contextualize() needs heads with a context layer (context_window > 0)")
        if hidden.ndim != 3 or hidden.shape[-1] != self.hidden_size or next_embeddings.shape != hidden.shape:
            raise ValueError(
                f"hidden and next_embeddings must both have shape (B, R, {self.hidden_size}), got "
                f"{tuple(hidden.shape)} and {tuple(next_embeddings.shape)}"
            )
        B, R, _ = hidden.shape
        if not 1 <= num_queries <= R:
            raise ValueError(f"num_queries must lie in 1..{R}, got {num_queries}")
        if valid is None:
            return torch.ones(B, R, dtype=torch.bool, device=hidden.device)
        if valid.shape != (B, R) or valid.dtype != torch.bool:
            raise ValueError(f"valid must be a bool tensor of shape {(B, R)}, got {valid.dtype} {tuple(valid.shape)}")
        return valid

    def step(self, i: int, state: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """One token-conditioned head: ``s + SiLU(W_i s + U_i e + b_i)``.

        Args:
            i: the head (0-based).
            state: Shape (..., hidden_size): s_i (s_0 = the target's final hidden state).
            embedding: Shape (..., hidden_size): the input embedding of the path's
                (i+1)-th token (i = 0: the root).

        Returns:
            s_{i+1}, shape (..., hidden_size), the weights' dtype.

        Raises:
            ValueError: the heads are not token-conditioned, i out of range, or a last
                dimension other than hidden_size.
        """
        if not self.token_conditioned:
            raise ValueError("step() needs token-conditioned heads (token_conditioned=True)")
        if not 0 <= i < self.num_heads:
            raise ValueError(f"i must lie in 0..{self.num_heads - 1}, got {i}")
        if state.shape[-1] != self.hidden_size or embedding.shape[-1] != self.hidden_size:
            raise ValueError(
                f"state and embedding must have last dimension {self.hidden_size}, got {tuple(state.shape)} and {tuple(embedding.shape)}"
            )
        state = state.to(self.weight.dtype)
        pre = (
            linear(state, self.weight[i]) + linear(embedding.to(self.weight.dtype), self.token_weight[i]) + self.bias[i]
        )
        return state + F.silu(pre)

    def forward(
        self, hidden: torch.Tensor, num_heads: Optional[int] = None, embeddings: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The heads' hidden states (the output head's inputs).

        Args:
            hidden: Shape (..., hidden_size), any float dtype: final hidden states h_t.
            num_heads: use the first heads only (None: all).
            embeddings: token-conditioned heads only (required there): shape
                (..., k, hidden_size), the input embeddings of the path's tokens x_{t+1}
                (the root) .. x_{t+k} (teacher forcing: the tokens the heads condition on).

        Returns:
            Shape (..., num_heads, hidden_size), the weights' dtype.

        Raises:
            ValueError: hidden's last dimension is not hidden_size, num_heads out of range,
                embeddings missing (conditioned heads), given (unconditioned heads) or of
                the wrong shape.
        """
        self._check_hidden(hidden)
        k = self._num_heads(num_heads)
        h = hidden.to(self.weight.dtype)
        if not self.token_conditioned:
            if embeddings is not None:
                raise ValueError("embeddings are only for token-conditioned heads")
            proj = torch.einsum("...j,kij->...ki", h, self.weight[:k])
            return h.unsqueeze(-2) + F.silu(proj)
        if embeddings is None:
            raise ValueError("token-conditioned heads need embeddings (the path's token embeddings)")
        if (
            embeddings.shape[:-2] != h.shape[:-1]
            or embeddings.shape[-2] < k
            or embeddings.shape[-1] != self.hidden_size
        ):
            raise ValueError(
                f"embeddings must have shape {tuple(h.shape[:-1]) + (k, self.hidden_size)}, got {tuple(embeddings.shape)}"
            )
        states, state = [], h
        for i in range(k):
            state = self.step(i, state, embeddings[..., i, :])
            states.append(state)
        return torch.stack(states, dim=-2)

    def logits(
        self,
        hidden: torch.Tensor,
        output_weight: torch.Tensor,
        num_heads: Optional[int] = None,
        embeddings: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Each head's next-token logits through the shared output head.

        Args:
            hidden: Shape (..., hidden_size): final hidden states at positions t.
            output_weight: Shape (vocab, hidden_size): the target's output head (``model.output.weight``).
            num_heads: the first heads only (None: all).
            embeddings: as in ``forward`` (token-conditioned heads).

        Returns:
            Shape (..., num_heads, vocab), float32; head i scores the token at t + i + 2.
        """
        states = self.forward(hidden, num_heads, embeddings).to(output_weight.dtype)
        return linear(states, output_weight).float()

    # ------------------------------------------------------------------ files
    def _file_fields(self) -> dict:
        return {
            "format": FORMAT if self.context_window else 2,  # format 2 readers can read heads without context
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "token_conditioned": self.token_conditioned,
            "context_window": self.context_window,
            "context_heads": self.context_heads,
            "context_head_dim": self.context_head_dim,
        }

    @classmethod
    def _kind_before_kind_field(cls, state: dict) -> str:
        return "eagle-head" if "fc" in state else KIND

    @classmethod
    def _from_config(cls, config: dict) -> "MedusaHeads":
        window = int(config.get("context_window", 0))
        return cls(
            int(config["hidden_size"]),
            int(config["num_heads"]),
            token_conditioned=bool(config.get("token_conditioned", False)),
            context_window=window,
            context_heads=int(config["context_heads"]) if window else None,
            context_head_dim=int(config["context_head_dim"]) if window else None,
            config=config,
        )

    @property
    def tree_choices(self) -> Optional[List[tuple]]:
        """The tuned tree stored with the weights (choice paths), or None."""
        c = self.config.get("tree_choices")
        return [tuple(p) for p in c] if c else None


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (..., R, heads, head_dim) at positions pos (R,), in the
    target's half-split layout (``model.rotate``)."""
    hd = x.shape[-1]
    inv = CONTEXT_ROPE_THETA ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = pos.to(torch.float32)[:, None] * inv  # (R, hd / 2)
    emb = torch.cat((ang, ang), dim=-1)[:, None, :]  # (R, 1, hd)
    return rotate(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


load_medusa_heads = MedusaHeads.load  # the shipped SmolLM2-135M-Instruct heads, or heads from a file


class MedusaDrafter(Drafter):
    """Draft with Medusa heads on the hidden state the engine hands over (no extra pass).

    Args:
        model: the target model (its output head is shared with the heads).
        heads: ``MedusaHeads``, a path to a heads file, or None for the shipped
            SmolLM2-135M-Instruct heads.
        tree: draft a static token tree instead of a chain.
        choices: the tree as Medusa choice paths (each a tuple of top-k ranks by depth);
            None takes the tree stored with the heads (else ``GENERIC_CHOICES``).  Paths
            deeper than the heads are dropped.
        max_nodes: keep at most this many tree nodes (root included), in the tree's order
            (by depth, then ranks); None keeps all.
        check_fingerprint: warn when the heads were trained on another model.
        size_by_cost: with ``tree``, each step keep per sequence only the nodes that maximise
            expected tokens per second against the measured pass cost (``adaptive.TreeBudget``,
            EAGLE-2's rule over the heads' path probabilities; trees grow from 2 nodes as the
            cost of larger passes is measured); False keeps the whole tree up to depth K.

    The depth of a draft is min(K, number of heads); a tree keeps its nodes of depth <= K.
    A sequence whose hidden state is unknown (a one-token prompt's first step) gets no drafts.

    Raises:
        ValueError: heads whose hidden size differs from the model's, heads whose weights are
            not all finite (``HeadFile.check_finite``: the message names the heads, their file
            and the weight), an empty choice list, max_nodes < 1.
        TypeError: size_by_cost not a bool.
    """

    name = "medusa"
    wants_hidden = True

    def __init__(
        self,
        model: Transformer,
        heads: Union[MedusaHeads, str, Path, None] = None,
        *,
        tree: bool = False,
        choices: Optional[Sequence[Sequence[int]]] = None,
        max_nodes: Optional[int] = None,
        check_fingerprint: bool = True,
        size_by_cost: bool = True,
    ):
        if max_nodes is not None and max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        if not isinstance(size_by_cost, bool):
            raise TypeError(f"size_by_cost must be True or False, got {size_by_cost!r}")
        self.model = model
        self.heads = heads = MedusaHeads.for_target(heads, model, check_fingerprint=check_fingerprint)
        self.tree = tree
        if tree:
            paths = choices if choices is not None else (heads.tree_choices or GENERIC_CHOICES)
            paths = [tuple(p) for p in paths if len(p) <= heads.num_heads]
            if not paths:
                raise ValueError("choices must hold at least one path no deeper than the heads")
            t = medusa_choices_to_tree(paths)  # nodes by depth, so every depth limit keeps a prefix
            n = len(t.parents) if max_nodes is None else min(max_nodes, len(t.parents))
            self.tree_parents = t.parents[:n]
            self.tree_depths = t.depths[:n].tolist()
            # node i is the rank_of_node[i]-th best token of head head_of_node[i] (root: any)
            self._head_of_node = (t.depths[:n] - 1).clamp(min=0)
            self._rank_of_node = t.topk_index[:n].clamp(min=0)
            self._width = int(self._rank_of_node.max()) + 1
            # _is_chain[N - 1]: the first N nodes form a chain (parents[i] = i - 1)
            continues = (t.parents[1:n] == torch.arange(n - 1)).tolist()
            self._is_chain = [all(continues[:m]) for m in range(n)]
            self.choices = list(t.choices[: n - 1])
            self.name = "medusa-tree"
            # the tree's nodes kept per sequence and step by the measured pass cost (EAGLE-2's
            # rule over the heads' path probabilities, against each run's calibration)
            self.budget = TreeBudget(n) if size_by_cost else None
            if heads.token_conditioned:
                self._index_conditioned_tree(model.device)
        if not tree:
            self.budget = None
        self.context_window = self.heads.context_window  # > 0: results carry features.context
        self._hidden: Optional[torch.Tensor] = None
        self._known: List[bool] = []
        self._context: List[Optional[torch.Tensor]] = []
        self._context_end: List[int] = []

    def _index_conditioned_tree(self, device: torch.device) -> None:
        """The tree's indices that token-conditioned heads draft by (int64 on ``device``).

        Per depth d < the tree's depth: the nodes of depth d that have children (each needs one
        head step along its own path), their parents' slots among the expanders of depth d - 1,
        the nodes of depth d + 1 and their parents' slots among the expanders of depth d.  Node
        ids are ordered by depth, so a depth limit never splits a depth."""
        n = len(self.tree_depths)
        par = self.tree_parents.tolist()
        expand = sorted({par[i] for i in range(1, n)})
        by_depth = [[p for p in expand if self.tree_depths[p] == d] for d in range(self.tree_depths[-1])]
        slot = {p: j for nodes in by_depth for j, p in enumerate(nodes)}
        kids = [[i for i in range(1, n) if self.tree_depths[i] == d + 1] for d in range(self.tree_depths[-1])]
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        self._expand_idx = [as_t(nodes) for nodes in by_depth]
        self._expand_parent_slot = [
            as_t([0] if d == 0 else [slot[par[p]] for p in nodes]) for d, nodes in enumerate(by_depth)
        ]
        self._child_idx = [as_t(c) for c in kids]
        self._child_slot = [as_t([slot[par[i]] for i in c]) for c in kids]
        self._child_rank = [self._rank_of_node.to(device)[c] for c in self._child_idx]
        self._child_width = [int(r.max()) + 1 for r in self._child_rank]

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    def observe(self, result: StepResult) -> None:
        """Begin a run (``result.started``: reset the tree budget and the kept hidden states)
        or count each sequence's accepted drafts for the tree budget's calibration; then keep
        the target's hidden states (``result.features``): the committed positions' for a
        context layer (``_keep_context``) and the last accepted node's, (B, H) (the heads'
        s_0)."""
        super().observe(result)
        if result.started:
            B = result.batch_size
            if self.budget is not None:
                self.budget.start(B, result.run.calibration)
            self._hidden = None
            self._known = [False] * B
            self._context = [None] * B
            self._context_end = [-1] * B
        elif self.budget is not None:
            self.budget.observe(result.num_accepted, result.active)
        f = result.features
        if f is None:
            return
        if f.context is not None:
            self._keep_context(f.context, f.context_positions, f.valid)
        self._hidden = f.last
        self._known = [bool(a) for a in f.valid]

    def _keep_context(self, hidden, first_positions, active) -> None:
        """Keep the hidden states of each sequence's last ``context_window`` positions
        (``TargetFeatures.context``: hidden[b] (n_b, H) of positions first_positions[b]..);
        rows that do not continue the kept ones replace them."""
        for b, (rows, first, a) in enumerate(zip(hidden, first_positions, active)):
            if not a or rows is None or rows.shape[0] == 0:
                continue
            kept, first = self._context[b], int(first)
            end = first + rows.shape[0] - 1
            if kept is not None and self._context_end[b] + 1 == first:
                rows = torch.cat([kept, rows.to(kept.dtype)])
            self._context[b] = rows[-self.context_window :]
            self._context_end[b] = end

    def _context_state(self, histories, depth: List[int]) -> torch.Tensor:
        """s_0 of every sequence from its kept context (``MedusaHeads.contextualize``); a
        sequence whose context does not end just before its root gets no drafts (depth 0)."""
        B, W = len(histories), self.context_window
        E = self.model.tok_embeddings.weight
        hidden = torch.zeros(B, W, self.heads.hidden_size, dtype=E.dtype, device=E.device)
        nxt = torch.zeros(B, W, dtype=torch.int64)
        valid = torch.zeros(B, W, dtype=torch.bool)
        for b, h in enumerate(histories):
            rows, end = self._context[b], self._context_end[b]
            if depth[b] == 0:
                continue
            if rows is None or end != len(h) - 2:  # the last row must be the root's predecessor
                depth[b] = 0
                continue
            n = rows.shape[0]
            hidden[b, W - n :] = rows.to(hidden.dtype)
            nxt[b, W - n :] = torch.tensor(h[end - n + 2 : end + 2], dtype=torch.int64)
            valid[b, W - n :] = True
        valid[:, -1] = True
        return self.heads.contextualize(hidden, E[nxt.to(E.device)], valid.to(E.device))[:, 0]

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        """Per sequence a chain (each head's argmax) or the static tree's nodes no deeper than
        min(K, heads), from the last hidden state ``observe`` kept: tokens (B, N) int64 on the
        host, ``probs`` None; the root alone where the hidden state is unknown."""
        histories, num_draft_tokens, active = request.histories, request.num_draft_tokens, request.active
        roots = [h[-1] for h in histories]
        if self._hidden is None:
            return Draft.from_lists([([r], [-1]) for r in roots])
        limit = self.tree_depths[-1] if self.tree else self.num_heads
        depth = [min(int(k), limit) if a and known else 0 for k, a, known in zip(num_draft_tokens, active, self._known)]
        D = max(depth)
        if D == 0:
            return Draft.from_lists([([r], [-1]) for r in roots])
        state = self._hidden
        if self.context_window:
            state = self._context_state(histories, depth)
            D = max(depth)
            if D == 0:
                return Draft.from_lists([([r], [-1]) for r in roots])
        if self.heads.token_conditioned:
            return self._propose_conditioned(roots, depth, D, state)
        logits = self.heads.logits(state, self.model.output.weight, D)  # (B, D, V)
        if not self.tree:
            return self._chain_draft(roots, logits.argmax(dim=-1), depth)
        N = bisect_right(self.tree_depths, D)
        best = logits.float().log_softmax(dim=-1).topk(self._width, dim=-1)
        top = best.indices.cpu()  # (B, D, width)
        tokens = top[:, self._head_of_node[:N], self._rank_of_node[:N]]  # (B, N)
        tokens[:, 0] = torch.tensor(roots, dtype=torch.int64)
        node_lp = best.values.cpu()[:, self._head_of_node[:N], self._rank_of_node[:N]]  # (B, N)
        return self._tree_draft(tokens, depth, node_lp)

    # ------------------------------------------------------------------ chain distributions
    @torch.inference_mode()
    def chain_begin(self, request: DraftRequest, vocab_size: int):
        """Head 0's distribution of the first draft token (``Drafter.chain_begin``); deeper
        heads follow the chain's tokens when they are token-conditioned."""
        histories, num_draft_tokens, active = request.histories, request.num_draft_tokens, request.active
        B = len(histories)
        roots = [h[-1] for h in histories]
        depth = [
            min(int(k), self.num_heads) if a and known else 0
            for k, a, known in zip(num_draft_tokens, active, self._known or [False] * B)
        ]
        self._chain = None
        if self._hidden is None or max(depth) == 0:
            return torch.zeros(B, vocab_size), torch.zeros(B, dtype=torch.bool)
        state = self._context_state(histories, depth) if self.context_window else self._hidden
        if max(depth) == 0:  # no sequence's context ends just before its root
            return torch.zeros(B, vocab_size), torch.zeros(B, dtype=torch.bool)
        W_out, E = self.model.output.weight, self.model.tok_embeddings.weight
        if self.heads.token_conditioned:
            state = self.heads.step(0, state, E[torch.tensor(roots, device=E.device)])
            logits = linear(state.to(W_out.dtype), W_out)
            self._chain = {"state": state, "depth": depth, "i": 0}
        else:
            every = self.heads.logits(state, W_out, max(depth))  # (B, D, V): head i for depth i + 1
            logits = every[:, 0]
            self._chain = {"every": every, "depth": depth, "i": 0}
        return draft_distribution(logits, self.sampling).cpu(), torch.tensor([d >= 1 for d in depth])

    @torch.inference_mode()
    def chain_extend(self, tokens):
        """The next head's distribution (``Drafter.chain_extend``)."""
        c = self._chain
        B = tokens.shape[0]
        if c is None or c["i"] + 1 >= max(c["depth"]):
            return torch.zeros(B, self.vocab_size), torch.zeros(B, dtype=torch.bool)
        c["i"] += 1
        i = c["i"]
        if self.heads.token_conditioned:
            W_out, E = self.model.output.weight, self.model.tok_embeddings.weight
            c["state"] = self.heads.step(i, c["state"], E[tokens.to(E.device)])
            logits = linear(c["state"].to(W_out.dtype), W_out)
        else:
            logits = c["every"][:, i]
        return draft_distribution(logits, self.sampling).cpu(), torch.tensor([d >= i + 1 for d in c["depth"]])

    @staticmethod
    def _chain_draft(roots: List[int], best: torch.Tensor, depth: List[int]) -> Draft:
        """A chain draft: each root followed by the first depth[b] of best[b] (B, D)."""
        best = best.cpu().tolist()
        return Draft.from_lists(
            [([r] + best[b][: depth[b]], chain_parents(depth[b] + 1)) for b, r in enumerate(roots)], is_chain=True
        )

    def _tree_draft(self, tokens: torch.Tensor, depth: List[int], node_lp: Optional[torch.Tensor] = None) -> Draft:
        """The static tree's first N nodes with these tokens (B, N); each sequence keeps
        the nodes no deeper than its depth[b].  With a tree budget (``size_by_cost``) and the
        nodes' own log-probabilities ``node_lp`` (B, N), each sequence keeps only the n - 1
        nodes of highest path probability (the product along the path: a child never above
        its parent, so the kept nodes hold their ancestors), n from ``TreeBudget.choose``."""
        B, N = tokens.shape
        num_nodes = torch.tensor([bisect_right(self.tree_depths, d) for d in depth], dtype=torch.int64)
        par = self.tree_parents[:N].expand(B, N).clone()
        if self.budget is None or node_lp is None:
            return Draft(tokens.cpu(), par, num_nodes, None, is_chain=self._is_chain[N - 1])
        parents = self.tree_parents[:N].tolist()
        path = node_lp.clone()
        for i in range(1, N):  # nodes by depth: a parent's path sum is final before its children's
            if parents[i] > 0:
                path[:, i] += path[:, parents[i]]
        toks = tokens.cpu().tolist()
        trees = []
        for b in range(B):
            m = int(num_nodes[b])
            if m <= 1:
                trees.append(([toks[b][0]], [-1]))
                continue
            values = path[b, 1:m].exp().tolist()
            order = sorted(range(1, m), key=lambda i: (-values[i - 1], i))  # ties: the earlier (a parent) first
            n = self.budget.choose(b, [values[i - 1] for i in order])
            kept = sorted([0] + order[: n - 1])
            self.budget.kept(b, [values[i - 1] for i in order[: n - 1]])
            slot = {node: j for j, node in enumerate(kept)}
            trees.append(([toks[b][i] for i in kept], [-1] + [slot[parents[i]] for i in kept[1:]]))
        return Draft.from_lists(trees, is_chain=False)

    def _propose_conditioned(self, roots: List[int], depth: List[int], D: int, hidden: torch.Tensor) -> Draft:
        """Token-conditioned heads: every node's children come from the head state of the
        path to it (root: s_1 = step_0(h, E[root]))."""
        B = len(roots)
        W_out, E = self.model.output.weight, self.model.tok_embeddings.weight
        root_t = torch.tensor(roots, dtype=torch.int64, device=E.device)
        if not self.tree:
            state, token, best = hidden, root_t, []
            for i in range(D):
                state = self.heads.step(i, state, E[token])
                token = linear(state.to(W_out.dtype), W_out).argmax(dim=-1)
                best.append(token)
            return self._chain_draft(roots, torch.stack(best, dim=1), depth)
        N = bisect_right(self.tree_depths, D)
        tokens = torch.empty(B, N, dtype=torch.int64, device=E.device)
        tokens[:, 0] = root_t
        node_lp = torch.zeros(B, N, dtype=torch.float32, device=E.device)  # each node's own log-probability
        states = hidden.unsqueeze(1)  # the head states of the previous depth's expanders; the root's: h_t
        for d in range(D):
            states = self.heads.step(
                d, states[:, self._expand_parent_slot[d]], E[tokens[:, self._expand_idx[d]]]
            )  # (B, n_d, hidden)
            logits = linear(states.to(W_out.dtype), W_out)
            top = logits.float().log_softmax(dim=-1).topk(self._child_width[d], dim=-1)  # (B, n_d, width)
            tokens[:, self._child_idx[d]] = top.indices[:, self._child_slot[d], self._child_rank[d]]
            node_lp[:, self._child_idx[d]] = top.values[:, self._child_slot[d], self._child_rank[d]]
        return self._tree_draft(tokens, depth, node_lp.cpu())
