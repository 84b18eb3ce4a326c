"""An EAGLE-style draft head with EAGLE-2's dynamic token tree.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty") drafts autoregressively at the *feature* level: a single decoder layer reads,
at position t, the target's final hidden state f_t (after its final norm: the input of the
output head) and the input embedding of the token that followed, x_{t+1}, and predicts the
next feature:

    u_t = W_fc [E(x_{t+1}); f_t] + b_fc,    g_t = Layer(u_{<=t}) ~ f_{t+1},
    q(x_{t+2}) = softmax(W_out g_t)

with E and W_out the target's own (frozen, shared) embedding and output head and Layer one
Llama decoder layer (pre-norm GQA attention with rotary positions over the head's own
sequence, SwiGLU MLP).  Deeper drafts feed the head its own predicted feature: the draft
at depth d + 1 reads (x^_{p+d}, g_{p+d-2}).  Training (``decoding.training.eagle``)
unrolls those steps (EAGLE-3's "training-time test", Li et al. 2025), so the head learns
from its own features, not only from the target's.

EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees") shapes the tree by the head's confidence: the path probability of a node is the
product of the head's probabilities along its path; each round expands the ``top_k`` nodes
of the newest depth with the highest path probability (each gets its ``top_k`` best
children), and after the last round all generated nodes are reranked by path probability
and the best ``max_nodes - 1`` kept (a prefix-closed set: a child is never more probable
than its parent).

The head's own KV cache holds the committed positions (their real features, handed over by
the engine's ``observe_context`` hook), at most ``window`` of them (a sliding window; the
training segments are as long); the draft tree's nodes attend to it and to their own
ancestors in the tree.

Each draft step runs the head's layer and an output head over V tokens; with SmolLM2's
49152 x 576 output head the latter dominates a draft step on a CPU.  The drafter therefore
drafts over a draft vocabulary (FR-Spec, Zhao et al. 2025, "FR-Spec: Accelerating
Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling"; EAGLE-3's
draft vocabulary): the most frequent tokens of the head's training labels, stored with the
head (``token_ranking``, ``config["draft_vocab_size"]``).  A token outside it is never
drafted; the target still verifies every draft, so nothing but the acceptance changes.

EAGLE-3 (Li et al. 2025) feeds the head more than the final hidden state: low-, mid- and
high-level features, the outputs of several target layers, fused by a linear layer into one
H-wide feature.  A head with ``feature_layers`` (l_1, ..., l_k) asks the engine for those
layers' outputs beside f_t (``Drafter.feature_layers``) and reads

    f'_t = W_fuse [f_t; n_1(h^{l_1}_t); ...; n_k(h^{l_k}_t)]

in place of f_t (n_i: an RMS norm with weights of its own, the residual streams' scales
differ by layer).  Only the committed positions have target features: deeper drafts still
read the head's own g.  ``with_feature_layers`` widens a head with W_fuse = [I 0 ... 0], which
drafts exactly as the head did, a starting point for fine-tuning.

Drafts are deterministic (top-k children; ``Draft.probs`` is None): greedy verification
keeps the output identical to greedy decoding and tree rejection sampling with one-hot q
keeps sampling exact.

Example::

    model, tok = load_smollm2()
    drafter = EagleDrafter(model)                # shipped SmolLM2-135M-Instruct head
    decoder = SpeculativeDecoder(model, drafter, stop_token_ids=[tok.eos_token_id])
    result = decoder.generate([ids], max_new_tokens=128, num_draft_tokens=6)
"""

from __future__ import annotations

import copy
import math
import numbers
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from specdec_kernels.checks import integer_at_least, layer_indices
from specdec_kernels.decoding import packed
from specdec_kernels.decoding.draft import Draft, Drafter, chain_parents, draft_distribution
from specdec_kernels.decoding.drafters.head_file import HeadFile
from specdec_kernels.decoding.engine.adaptive import TreeBudget
from specdec_kernels.decoding.model import Transformer, fused_layer_args, linear, rotate

FORMAT = 1
FEATURE_LAYERS_FORMAT = 2  # the format of files of heads with feature_layers (format 1 readers would drop them)
KIND = "eagle-head"  # config["kind"] of the files ``EagleHead.save`` writes
SHIPPED = Path(__file__).resolve().parents[2] / "data" / "eagle" / "smollm2-135m-instruct.pt"
# the most new rows the head's one-call layer takes whole when a step ingests them (their
# outputs but the last are not needed: a longer block computes its keys with ``project``)
FUSED_INGEST_ROWS = 8


class EagleHead(HeadFile):
    """The draft head: ``fc`` on [embedding; feature], one Llama decoder layer.

    Args:
        hidden_size: the target's hidden size H.
        num_heads, num_kv_heads, head_dim: the layer's attention (GQA: num_heads a multiple
            of num_kv_heads; head_dim even, rotary).
        intermediate_size: the SwiGLU MLP's width.
        window: the most committed positions the head attends to (its training segment).
        rope_theta: the rotary base.
        eps: the RMS norms' epsilon.
        config: free-form metadata stored with the weights (base model, fingerprint,
            training command; ``draft_vocab_size``, the draft vocabulary the trainer
            recommends).
        feature_layers: target layers (0-based) whose outputs the head fuses with the final
            hidden state (EAGLE-3's multi-layer features); () reads the final hidden state
            alone (EAGLE).

    Attributes (Parameters): ``fc`` (H, 2H) and ``fc_bias`` (H,); ``attention_norm``,
    ``ffn_norm`` (H,); ``wqkv`` ((nh + 2 nkv) hd, H); ``wo`` (H, nh hd); ``w13``
    (2 I, H); ``w2`` (H, I); with k = len(feature_layers) > 0 also ``fuse`` (H, (1 + k) H)
    and ``feature_norms`` (k, H).  ``token_ranking``: None or (M,) int64 CPU, the tokens of the
    training labels, most frequent first (``set_token_ranking``; the drafter's draft
    vocabulary is its head).

    Raises:
        ValueError: non-positive sizes, num_heads not a multiple of num_kv_heads, an odd
            head_dim, window < 1, feature_layers not distinct indices >= 0.
        TypeError: feature_layers not a sequence of ints.
    """

    KIND = KIND
    DESCRIPTION, ARTICLE = "EAGLE head", "an"
    NON_FINITE_NOTE = ", with quantize_head=True or False"
    READABLE_FORMATS = (FORMAT, FEATURE_LAYERS_FORMAT)
    SHIPPED = SHIPPED

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        *,
        window: int = 256,
        rope_theta: float = 10000.0,
        eps: float = 1e-6,
        config: Optional[dict] = None,
        feature_layers: Sequence[int] = (),
    ):
        super().__init__()
        for name, v in (
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("intermediate_size", intermediate_size),
            ("window", window),
        ):
            integer_at_least(name, v, 1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embedding), got {head_dim}")
        H, I = int(hidden_size), int(intermediate_size)
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = (
            H,
            int(num_heads),
            int(num_kv_heads),
            int(head_dim),
        )
        self.intermediate_size, self.window, self.rope_theta, self.eps = I, int(window), float(rope_theta), float(eps)

        def init(*shape):
            return nn.Parameter(torch.empty(*shape).uniform_(-1 / math.sqrt(shape[-1]), 1 / math.sqrt(shape[-1])))

        self.fc = init(H, 2 * H)
        self.fc_bias = nn.Parameter(torch.zeros(H))
        self.attention_norm = nn.Parameter(torch.ones(H))
        self.wqkv = init((self.num_heads + 2 * self.num_kv_heads) * self.head_dim, H)
        self.wo = init(H, self.num_heads * self.head_dim)
        self.ffn_norm = nn.Parameter(torch.ones(H))
        self.w13 = init(2 * I, H)
        self.w2 = init(H, I)
        self.feature_layers: Tuple[int, ...] = layer_indices("feature_layers", feature_layers)
        k = len(self.feature_layers)
        if k:  # starts as [I 0 ... 0]: the final hidden state alone, as an EAGLE head reads it
            self.fuse = nn.Parameter(torch.cat([torch.eye(H), torch.zeros(H, k * H)], dim=1))
            self.feature_norms = nn.Parameter(torch.ones(k, H))
        self.config: Dict = dict(config or {})
        self.source: Optional[str] = None  # the file it was loaded from (``load``), for messages
        self.token_ranking: Optional[torch.Tensor] = None
        # the products' numerics (``decoding.model.linear``): "int8" takes 8-bit activations for
        # the weights with a packed form (a ``quantized`` head's); not stored in files
        self.numerics = "float32"
        self._inv_freq: Optional[torch.Tensor] = None  # the rotary frequencies, made on first use

    def set_token_ranking(self, ranking: Union[torch.Tensor, Sequence[int], None]) -> None:
        """Store the training labels' tokens, most frequent first (None: forget them).

        Raises:
            ValueError: not a 1-D sequence of distinct integers >= 0.
        """
        self.token_ranking = None if ranking is None else _token_ids(ranking, None, "ranking")

    @property
    def recommended_draft_vocab(self) -> Optional[torch.Tensor]:
        """The draft vocabulary the head file recommends: the first ``config["draft_vocab_size"]``
        tokens of ``token_ranking`` (int64, most frequent first), or None (the whole vocabulary)
        when the head has no ranking or no size."""
        n = self.config.get("draft_vocab_size")
        return None if self.token_ranking is None or not n else self.token_ranking[: int(n)]

    @classmethod
    def for_model(
        cls,
        model: Transformer,
        *,
        window: int = 256,
        intermediate_size: Optional[int] = None,
        config: Optional[dict] = None,
        feature_layers: Sequence[int] = (),
    ) -> "EagleHead":
        """A fresh head shaped like one of ``model``'s layers (EAGLE's choice).

        Raises:
            ValueError: a ``feature_layers`` index the model does not have, and as the class.
            TypeError: as the class.
        """
        a = model.args
        layer_indices("feature_layers", feature_layers, a.num_layers)
        return cls(
            a.hidden_size,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            intermediate_size or a.intermediate_size,
            window=window,
            rope_theta=a.rope_theta,
            eps=a.rms_norm_eps,
            config=config,
            feature_layers=feature_layers,
        )

    def with_feature_layers(self, feature_layers: Sequence[int]) -> "EagleHead":
        """A copy of this head (weights, config, token ranking) that also reads the outputs of
        ``feature_layers``, with ``fuse`` = [I 0 ... 0] and unit ``feature_norms``: it drafts
        exactly as this head does until trained (EAGLE-3 fine-tuning from an EAGLE head).

        Raises:
            ValueError: this head already reads feature layers; bad ``feature_layers``.
        """
        if self.feature_layers:
            raise ValueError(f"the head already reads feature layers {list(self.feature_layers)}")
        p = next(self.parameters())
        wide = EagleHead(
            **{k: v for k, v in self._file_fields().items() if k != "format"},
            config=self.config,
            feature_layers=feature_layers,
        ).to(device=p.device, dtype=p.dtype)
        missing, unexpected = wide.load_state_dict(self.state_dict(), strict=False)
        assert set(missing) == {"fuse", "feature_norms"} and not unexpected, (missing, unexpected)
        wide.token_ranking, wide.source = self.token_ranking, self.source
        return wide.train(self.training)

    MATRICES = ("fc", "wqkv", "wo", "w13", "w2", "fuse")  # the matrix-product weights (fuse: with feature layers)

    def quantizable(self) -> bool:
        """Whether ``quantized`` can make a copy: a float32 head on CPU, the C++ extension built."""
        p = next(self.parameters())
        return p.dtype == torch.float32 and p.device.type == "cpu" and packed.has_kernel()

    def quantized(self) -> "EagleHead":
        """A copy of this head (eval mode) whose matrix-product weights are rounded to ggml's Q8_0
        form (``packed.quantize_scaled8``) and registered with their packed forms, so that a
        draft step on a CPU streams 1.125 bytes per weight instead of 4 and, with
        ``numerics = "int8"``, multiplies in 8-bit integers (``decoding.model.linear``).

        The rounding changes the head's drafts slightly (a weight moves by at most about 1/254
        of its block's largest), never the output: the target verifies every draft.  Norms
        and the bias stay float32; so does a matrix whose rounded form does not pack (one with
        a block whose largest magnitude is below 127 x 6.1e-5, fp16's normal range, where the
        rounded scale may leave its largest code below 127).  ``self`` is not changed.

        Returns:
            The copy, with ``config["quantized"] = "q8_0"`` and the names of the rounded
            matrices in ``quantized_matrices``.

        Raises:
            ValueError: the head is not float32 on CPU, the C++ extension (the packed
                products) is missing, or a weight is not finite (``check_finite``: the
                message names the head and the weight; rounding cannot help).
        """
        self.check_finite()
        if not self.quantizable():
            p = next(self.parameters())
            raise ValueError(
                f"quantized() needs a float32 head on CPU and the C++ extension, got {p.dtype} on {p.device}"
                + ("" if packed.has_kernel() else " without the extension")
            )
        # ordinary tensors even when called under inference mode: the packed registry stamps
        # each weight with its version counter, which inference tensors lack
        with torch.inference_mode(False), torch.no_grad():
            out = copy.deepcopy(self).eval()
            out.config = {**self.config, "quantized": "q8_0"}
            out.quantized_matrices = []
            for name in self.MATRICES:
                w = getattr(out, name, None)
                if w is None:
                    continue
                rounded = packed.quantize_scaled8(w)
                form = packed.pack_weight(rounded)
                if form is None:
                    continue
                w.copy_(rounded)
                packed.register(w, form)
                out.quantized_matrices.append(name)
        return out

    # ------------------------------------------------------------------ the layer, in parts
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as the H-wide feature the head reads: ``features`` (..., H)
        unchanged without ``feature_layers``; else (..., (1 + k) H), the final hidden state
        then the k layers' outputs, fused (W_fuse [f; n_1(h_1); ...; n_k(h_k)]).

        Raises:
            ValueError: a last dimension other than (1 + k) H.
        """
        H, k = self.hidden_size, len(self.feature_layers)
        if features.shape[-1] != (1 + k) * H:
            raise ValueError(
                f"features must be (..., {(1 + k) * H}) (the final hidden state and {k} layer outputs of"
                f" width {H}), got {tuple(features.shape)}"
            )
        if not k:
            return features
        dt = self.fuse.dtype
        layers = features[..., H:].to(dt).unflatten(-1, (k, H))
        normed = F.rms_norm(layers, (H,), eps=self.eps) * self.feature_norms
        return linear(torch.cat([features[..., :H].to(dt), normed.flatten(-2)], dim=-1), self.fuse, self.numerics)

    def inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """u = fc [embedding; feature] + b: (..., H) from two (..., H) tensors."""
        dt = self.fc.dtype
        return linear(torch.cat([embeddings.to(dt), features.to(dt)], dim=-1), self.fc, self.numerics) + self.fc_bias

    def project(self, u: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of u (B, M, H) at integer positions (B, M): q (B, M, nh,
        hd), k and v (B, M, nkv, hd), q and k rotated."""
        B, M, _ = u.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.rms_norm(u, (self.hidden_size,), self.attention_norm, self.eps)
        q, k, v = linear(x, self.wqkv, self.numerics).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        cos, sin = self.rotary(positions, u.dtype)
        return rotate(q.view(B, M, nh, hd), cos, sin), rotate(k.view(B, M, nkv, hd), cos, sin), v.view(B, M, nkv, hd)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, M, 1, hd) in ``dtype`` of the rotary angles at integer positions (B, M)
        (transformers' Llama layout: the hd / 2 frequencies twice)."""
        hd, dev = self.head_dim, positions.device
        inv = self._inv_freq
        if inv is None or inv.device != dev:
            inv = self._inv_freq = self.rope_theta ** (-torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd)
        ang = positions.to(torch.float32)[..., None] * inv  # (B, M, hd / 2)
        emb = torch.cat((ang, ang), dim=-1)[:, :, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of q (B, M, nh, hd) over keys / values (B, S, nkv, hd) where mask (B, M,
        S) bool is True; every query must see at least one key.  Returns (B, M, nh hd)."""
        B, M, nh, hd = q.shape
        rep = nh // self.num_kv_heads
        k = keys.transpose(1, 2).repeat_interleave(rep, dim=1)
        v = values.transpose(1, 2).repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
        return a.transpose(1, 2).reshape(B, M, nh * hd)

    def finish(self, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output g from its input u and the attention output (both (..., H))."""
        a = u + linear(attn, self.wo, self.numerics)
        x = F.rms_norm(a, (self.hidden_size,), self.ffn_norm, self.eps)
        gate, up = linear(x, self.w13, self.numerics).chunk(2, dim=-1)
        return a + linear(F.silu(gate) * up, self.w2, self.numerics)

    def forward(
        self, features: torch.Tensor, embeddings: torch.Tensor, valid: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Teacher-forced step over consecutive positions: g_t for every t.

        Args:
            features: (B, L, H) the target's final hidden states f_t of L consecutive positions
                ((B, L, (1 + k) H) with k ``feature_layers``: then their outputs, appended).
            embeddings: (B, L, H) the input embeddings of x_{t+1}.
            valid: (B, L) bool or None: rows that exist (a query sees the valid rows at or
                before it, and itself).

        Returns:
            (B, L, H): g_t, the head's prediction of f_{t+1}.
        """
        B, L, _ = features.shape
        u = self.inputs(self.fuse_features(features), embeddings)
        pos = torch.arange(L, device=u.device).expand(B, L)
        q, k, v = self.project(u, pos)
        causal = torch.ones(L, L, dtype=torch.bool, device=u.device).tril()
        mask = (
            causal.expand(B, L, L)
            if valid is None
            else (causal[None] & valid[:, None, :]) | torch.eye(L, dtype=torch.bool, device=u.device)
        )
        return self.finish(u, self.attend(q, k, v, mask))

    # ------------------------------------------------------------------ files
    def _file_fields(self) -> dict:
        return {
            "format": FEATURE_LAYERS_FORMAT if self.feature_layers else FORMAT,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "window": self.window,
            "rope_theta": self.rope_theta,
            "eps": self.eps,
            **({"feature_layers": list(self.feature_layers)} if self.feature_layers else {}),
        }

    def _extra_payload(self) -> dict:
        return {} if self.token_ranking is None else {"token_ranking": self.token_ranking.to(torch.int32)}

    def _read_extra_payload(self, payload: dict) -> None:
        self.set_token_ranking(payload.get("token_ranking"))

    @classmethod
    def _kind_before_kind_field(cls, state: dict) -> str:
        return "medusa-heads" if "weight" in state and "fc" not in state else KIND

    @classmethod
    def _from_config(cls, c: dict) -> "EagleHead":
        return cls(
            int(c["hidden_size"]),
            int(c["num_heads"]),
            int(c["num_kv_heads"]),
            int(c["head_dim"]),
            int(c["intermediate_size"]),
            window=int(c["window"]),
            rope_theta=float(c["rope_theta"]),
            eps=float(c["eps"]),
            config=c,
            feature_layers=c["feature_layers"] if c["format"] == FEATURE_LAYERS_FORMAT else (),
        )


def _token_ids(ids, vocab_size: Optional[int], name: str) -> torch.Tensor:
    """ids as a 1-D int64 CPU tensor of distinct tokens in [0, vocab_size) (no upper bound
    when vocab_size is None), in the order given.

    Raises:
        ValueError: another shape, a non-integer dtype, a repeated or out-of-range id, none.
    """
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids))
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of token ids, got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got {t.dtype}")
    t = t.detach().to("cpu", torch.int64)
    if int(t.min()) < 0:
        raise ValueError(f"{name} holds a negative token id ({int(t.min())})")
    if vocab_size is not None and int(t.max()) >= vocab_size:
        raise ValueError(f"{name} holds token id {int(t.max())}, outside the vocabulary of {vocab_size}")
    if torch.unique(t).numel() != t.numel():
        raise ValueError(f"{name} repeats a token id")
    return t


load_eagle_head = EagleHead.load  # the shipped SmolLM2-135M-Instruct head, or one from a file


class EagleDrafter(Drafter):
    """Draft with an EAGLE-style head: EAGLE-2's dynamic tree, or a chain.

    Args:
        model: the target (its embedding and output head are shared with the head).
        head: an ``EagleHead``, a path to a head file, or None for the shipped head.
        tree: draft EAGLE-2's dynamic tree; False: a chain (the head's argmax at each depth).
        top_k: nodes expanded per depth and children per expanded node (tree only).
        max_nodes: the largest draft, root included (a tree's node budget; it caps a chain
            only through ``size_by_cost``'s rule, as the chain's K caps it anyway).
        size_by_cost: each step, keep per sequence the number of nodes that maximises
            expected tokens per second (``adaptive.TreeBudget``: EAGLE-2's rule, the expected
            accepted length as the sum of the kept nodes' path probabilities, scaled by the
            acceptance this drafter measures as it runs, against the step cost by node count
            that the engine's cost-model policy measured on this machine), at most
            ``max_nodes``; without a cost-model policy ``max_nodes``.  A chain sized so
            verifies only the nodes the rule keeps, and where its draft steps run in one
            native call each (``_chain_start``) it stops drafting once the rule could keep no
            deeper node (``TreeBudget.wants_more``).  False: a tree keeps ``max_nodes``, a
            chain its K.
        max_depth: the deepest draft; the engine's K (``num_draft_tokens``) caps it further.
        check_fingerprint: warn when the head was trained on another model.
        draft_vocab: the tokens the head may draft (FR-Spec, Zhao et al. 2025; EAGLE-3's
            draft vocabulary): its output head is the target's restricted to them, so a
            draft step reads a fraction of the (V, H) output head.  ``"auto"``: the
            head's recommended size (``config["draft_vocab_size"]``) of its
            ``token_ranking``, or the whole vocabulary when the head has none; an int n:
            the n most frequent tokens of its ranking (n >= V: the whole vocabulary);
            a sequence of token ids; None: the whole vocabulary.  Lossless either way:
            the target verifies every draft, and a chain's distribution (``chain_begin``)
            is the head's over the draft vocabulary, 0 elsewhere, which is what is sampled.
        quantize_head: draft with ``head.quantized()``, a copy whose matrices are rounded to
            Q8_0 and read packed (a CPU draft step streams about a quarter of the bytes; with
            the model's ``numerics`` "int8", 8-bit products).  None (default): when the head
            is float32 on CPU and the C++ extension is built; True: always (ValueError where
            it cannot); False: never.  The head passed in is not changed.

    A sequence whose features do not reach its root (a one-token prompt's first step) gets
    no drafts.

    Attributes:
        budget: the ``TreeBudget`` (size_by_cost) or None; the engine hands it its policy.
        path_logprobs: after each ``propose``, per sequence, the head's log path probability
            (natural log, float; the head's softmax over the draft vocabulary) of every node
            of its draft, root (0.0) first.
        draft_vocab: None (the whole vocabulary) or (Vd,) int64 on the model's device, the
            draft vocabulary, ascending ids.
        head: the head that drafts (with ``head_quantized``, the drafter's quantized copy).
        head_quantized: whether it is ``head.quantized()`` (see ``quantize_head``).

    Raises:
        ValueError: a head whose hidden size differs from the model's; top_k, max_nodes or
            max_depth < 1; a draft_vocab that is not "auto", None, an int >= 1 or distinct
            ids inside the vocabulary, an int with a head that stores no ranking, or one
            smaller than top_k; quantize_head=True with a head that is not float32 on CPU or
            without the C++ extension; a head whose weights are not all finite, whatever
            quantize_head (``HeadFile.check_finite``: the message names the head, its file
            and the weight).
        TypeError: quantize_head not None or a bool; size_by_cost not a bool.
    """

    name = "eagle"
    wants_hidden = True

    def __init__(
        self,
        model: Transformer,
        head: Union[EagleHead, str, Path, None] = None,
        *,
        tree: bool = True,
        top_k: int = 10,
        max_nodes: int = 64,
        max_depth: int = 7,
        size_by_cost: bool = True,
        check_fingerprint: bool = True,
        draft_vocab: Union[str, int, Sequence[int], torch.Tensor, None] = "auto",
        quantize_head: Optional[bool] = None,
    ):
        for name, v in (("top_k", top_k), ("max_nodes", max_nodes), ("max_depth", max_depth)):
            integer_at_least(name, v, 1)
        if quantize_head is not None and not isinstance(quantize_head, bool):
            raise TypeError(f"quantize_head must be None, True or False, got {quantize_head!r}")
        self.model = model
        self.head = EagleHead.for_target(head, model, check_fingerprint=check_fingerprint)
        self.head_quantized = self.head.quantizable() if quantize_head is None else quantize_head
        if self.head_quantized:
            self.head = self.head.quantized()
        self.tree = bool(tree)
        self.top_k = int(top_k) if tree else 1
        self.max_nodes = int(max_nodes)
        self.max_depth = int(max_depth)
        if not isinstance(size_by_cost, bool):
            raise TypeError(f"size_by_cost must be True or False, got {size_by_cost!r}")
        self.budget = TreeBudget(self.max_nodes) if size_by_cost else None
        self.context_window = self.head.window  # the engine hands over the committed positions' features
        self.feature_layers = self.head.feature_layers  # and, for an EAGLE-3 head, these layers' outputs
        W_out = model.output.weight
        self.draft_vocab = self._draft_vocab(draft_vocab)
        if self.draft_vocab is not None:
            self.draft_vocab = self.draft_vocab.to(W_out.device)
        self._W_draft = W_out if self.draft_vocab is None else W_out[self.draft_vocab].contiguous()
        if self._W_draft is not W_out and packed.packed_form(W_out) is not None:
            # rows of an exactly block-quantised output head are too: ``linear`` may then
            # measure the packed product on them as on the target's own head
            form = packed.pack_weight(self._W_draft)
            if form is not None:
                packed.register(self._W_draft, form)
        if self._W_draft.shape[0] < self.top_k:
            raise ValueError(f"top_k ({self.top_k}) exceeds the draft vocabulary ({self._W_draft.shape[0]} tokens)")
        self.name = "eagle-tree" if tree else "eagle"
        self._reset(0)

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def _draft_vocab(self, spec) -> Optional[torch.Tensor]:
        """The draft vocabulary (ascending ids) that ``spec`` names, None for the whole one."""
        V, ranking = self.vocab_size, self.head.token_ranking
        if isinstance(spec, str):
            if spec != "auto":
                raise ValueError(f'draft_vocab must be "auto", None, an int or token ids, got {spec!r}')
            n = self.head.config.get("draft_vocab_size")
            if ranking is None or not n:
                return None
            spec = int(n)
        if spec is None:
            return None
        if isinstance(spec, bool):
            raise ValueError(f'draft_vocab must be "auto", None, an int or token ids, got {spec!r}')
        if isinstance(spec, numbers.Integral) or (
            isinstance(spec, torch.Tensor) and spec.dim() == 0 and not spec.dtype.is_floating_point
        ):
            n = int(spec)
            if n < 1:
                raise ValueError(f"draft_vocab must be >= 1 tokens, got {n}")
            if n >= V:
                return None
            if ranking is None:
                raise ValueError("draft_vocab as a size needs a head that stores its token ranking (this one has none)")
            if int(ranking.max()) >= V:
                raise ValueError(
                    f"the head's token ranking holds token {int(ranking.max())}, outside the model's vocabulary of {V}"
                )
            ids = ranking[:n]
        else:
            ids = _token_ids(spec, V, "draft_vocab")
        return None if ids.numel() >= V else ids.sort().values

    def _tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary as token ids."""
        return idx if self.draft_vocab is None else self.draft_vocab[idx]

    def _full(self, probs: torch.Tensor) -> torch.Tensor:
        """(R, Vd) probabilities over the draft vocabulary as (R, V), 0 outside it."""
        if self.draft_vocab is None:
            return probs
        out = probs.new_zeros(probs.shape[0], self.vocab_size)
        out[:, self.draft_vocab] = probs
        return out

    def _reset(self, batch: int) -> None:
        self._keys: List[Optional[torch.Tensor]] = [None] * batch  # (n, nkv, hd) committed positions, last `window`
        self._values: List[Optional[torch.Tensor]] = [None] * batch
        self._end = [-1] * batch  # the last position in the cache
        self._root: List[Optional[torch.Tensor]] = [None] * batch  # (H,) the head's output at position end
        self._pending: List[List[Tuple[int, torch.Tensor]]] = [[] for _ in range(batch)]

    def start(self, histories, capacity, sampling, generators) -> None:
        super().start(histories, capacity, sampling, generators)
        if self.head_quantized:  # our copy: its products follow the target's numerics
            self.head.numerics = self.model.numerics
        self._reset(len(histories))
        if self.budget is not None:
            self.budget.start(len(histories))

    def observe(self, accepted_nodes, num_accepted, active) -> None:
        """Counts each sequence's accepted drafts for the tree budget's calibration."""
        if self.budget is not None:
            self.budget.observe(num_accepted, active)

    def observe_context(self, hidden, first_positions, active) -> None:
        """Keep the committed positions' features until a step that drafts feeds them to the
        head's cache (it needs the token that followed each, known by then); blocks that lie
        wholly before the newest ``window`` positions are dropped (the cache would drop them)."""
        for b, (rows, first, a) in enumerate(zip(hidden, first_positions, active)):
            if a and rows is not None and rows.shape[0]:
                pending = self._pending[b]
                pending.append((int(first), rows.detach()))
                oldest = int(first) + rows.shape[0] - self.head.window  # the oldest position still needed
                while pending and pending[0][0] + pending[0][1].shape[0] <= oldest:
                    pending.pop(0)

    def _ingest(self, b: int, history: Sequence[int]) -> bool:
        """Feed sequence b's pending features (positions up to its root's predecessor) to the
        head's cache and compute the head's output at the last of them (the root query, which
        every draft of the step starts from); True when the cache then ends just before the
        root.  Called only when the sequence drafts: the features wait in ``_pending``
        meanwhile.  Rows before the window that ends at the root's predecessor are skipped (a
        row's key and value depend on that row alone, and the window would drop them).  With
        ``_fused_layer`` the new rows run through the head's layer in one native call, else
        through its Python ops."""
        root_pos = len(history) - 1
        E = self.model.tok_embeddings.weight
        blocks, start = [], None
        for first, rows in self._pending[b]:
            lo = max(first, root_pos - self.head.window)
            if lo > self._end[b] + 1:  # a gap, or nothing cached inside the window: start over
                self._keys[b] = self._values[b] = self._root[b] = None
                self._end[b] = lo - 1
                blocks, start = [], None
            skip = self._end[b] + 1 - first
            rows = rows[max(0, skip) : max(0, root_pos - first)]
            if rows.shape[0] == 0:
                continue
            start = first + max(0, skip) if start is None else start
            blocks.append(rows)
            self._end[b] = first + max(0, skip) + rows.shape[0] - 1
        self._pending[b] = []
        if blocks:
            rows = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
            N = rows.shape[0]
            nxt = torch.tensor(history[start + 1 : start + 1 + N], dtype=torch.int64, device=E.device)
            u = self.head.inputs(self.head.fuse_features(rows.to(E.dtype)[None]), E[nxt][None])  # (1, N, H)
            old = 0 if self._keys[b] is None else min(self._keys[b].shape[0], self.head.window - N)
            fused = self._fused_layer() if E.dtype == torch.float32 else None
            if fused is not None:
                keys, values, g = self._fused_rows(b, u, start, old, fused)
            else:
                pos = torch.arange(start, start + N, device=E.device)
                q, k, v = self.head.project(u, pos[None])
                keys = k[0] if not old else torch.cat([self._keys[b][-old:], k[0]])
                values = v[0] if not old else torch.cat([self._values[b][-old:], v[0]])
                ok = torch.ones(1, 1, keys.shape[0], dtype=torch.bool, device=E.device)
                g = self.head.finish(u[:, -1:], self.head.attend(q[:, -1:], keys[None], values[None], ok))
            self._keys[b], self._values[b], self._root[b] = keys, values, g[0, -1]
        return self._end[b] == root_pos - 1 and self._root[b] is not None

    def _fused_rows(self, b: int, u: torch.Tensor, start: int, old: int, fused: tuple):
        """The head's layer over sequence b's new rows u (1, N, H) at positions start.. in one
        ``specdec_engine::decoder_layer`` call, after its last ``old`` committed keys: the committed
        keys and values then ((old + N, nkv, hd) each) and the outputs of the rows the call
        ran ((1, M, H), the last row's last).  Only the last row's output is used: beyond
        ``FUSED_INGEST_ROWS`` rows (a prompt, a long run of steps without drafts) the others
        get their keys and values from ``project`` alone instead of the whole layer."""
        head, N = self.head, u.shape[1]
        k_cache = torch.empty(1, head.num_kv_heads, old + N, head.head_dim)
        v_cache = torch.empty_like(k_cache)
        if old:
            k_cache[0, :, :old] = self._keys[b][-old:].transpose(0, 1)
            v_cache[0, :, :old] = self._values[b][-old:].transpose(0, 1)
        lead = N - 1 if N > FUSED_INGEST_ROWS else 0
        if lead:
            _, k, v = head.project(u[:, :lead], torch.arange(start, start + lead)[None])
            k_cache[0, :, old : old + lead] = k[0].transpose(0, 1)
            v_cache[0, :, old : old + lead] = v[0].transpose(0, 1)
        cos, sin = head.rotary(torch.arange(start + lead, start + N)[None], torch.float32)
        lens = torch.tensor([old + lead], dtype=torch.int32)
        g = self._layer_call(u[:, lead:], cos, sin, k_cache, v_cache, lens, fused)
        return k_cache[0].transpose(0, 1).contiguous(), v_cache[0].transpose(0, 1).contiguous(), g

    @torch.inference_mode()
    def propose(self, histories, num_draft_tokens, active) -> Draft:
        B = len(histories)
        roots = [h[-1] for h in histories]
        depth = [0] * B
        for b in range(B):
            # a sequence that drafts nothing this step leaves its features pending
            ready = self._ingest(b, histories[b]) if active[b] and int(num_draft_tokens[b]) > 0 else False
            depth[b] = min(int(num_draft_tokens[b]), self.max_depth) if ready else 0
        D = max(depth)
        if D == 0:
            self.path_logprobs = [[0.0] for _ in roots]
            return Draft.from_lists([([r], [-1]) for r in roots])
        head, E = self.head, self.model.tok_embeddings.weight
        dev, dt = E.device, E.dtype
        run = [b for b in range(B) if depth[b] > 0]
        # the frontier width: top_k, or what the tree budget's latest choices can use
        R, k = len(run), self.top_k if self.budget is None else self.budget.width(run, self.top_k)
        if not self.tree:
            state = self._chain_start(run)
            if state is not None:
                return self._fused_chain(state, roots, run, depth, D)
        nkv, hd = head.num_kv_heads, head.head_dim
        ctx_k, ctx_v, ctx_ok, g = self._root_outputs(run)
        S = ctx_k.shape[1]
        logp = torch.log_softmax(self._logits(g), dim=-1)  # (R, 1, V)

        # the node pool: per running sequence, tokens, parents, scores (log path
        # probability), depths; node 0 is the root
        top = logp[:, 0].topk(k, dim=-1)
        tok = torch.cat(
            [torch.tensor([[roots[b]] for b in run], device=dev), self._tokens(top.indices)], dim=1
        )  # (R, 1 + k)
        par = torch.cat([torch.full((R, 1), -1, device=dev), torch.zeros(R, k, dtype=torch.int64, device=dev)], dim=1)
        score = torch.cat([torch.zeros(R, 1, device=dev), top.values], dim=1)
        dep = torch.cat(
            [torch.zeros(R, 1, dtype=torch.int64, device=dev), torch.ones(R, k, dtype=torch.int64, device=dev)], dim=1
        )
        frontier = torch.arange(1, 1 + k, device=dev).expand(R, k)  # pool ids of the nodes to expand next
        parent_g = g.expand(R, k, -1)  # the head output of each frontier node's parent
        # expanded nodes' keys / values and ancestor sets (over the expanded slots)
        tree_k = torch.zeros(R, 0, nkv, hd, dtype=dt, device=dev)
        tree_v = torch.zeros_like(tree_k)
        anc = torch.zeros(R, k, 0, dtype=torch.bool, device=dev)  # frontier node -> expanded ancestors
        for d in range(1, D):
            u = head.inputs(parent_g, E[tok.gather(1, frontier)])
            q, kk, vv = head.project(
                u, (torch.tensor([self._end[b] for b in run], device=dev)[:, None] + d).expand(R, k)
            )
            tree_k, tree_v = torch.cat([tree_k, kk], dim=1), torch.cat([tree_v, vv], dim=1)
            own = torch.zeros(R, k, k, dtype=torch.bool, device=dev)
            own[:, torch.arange(k), torch.arange(k)] = True
            anc = torch.cat([anc, own], dim=2)  # (R, k, n_exp + k): ancestors and itself
            mask = torch.cat([ctx_ok[:, None].expand(R, k, S), anc], dim=2)
            g_f = head.finish(
                u, head.attend(q, torch.cat([ctx_k, tree_k], 1), torch.cat([ctx_v, tree_v], 1), mask)
            )  # (R, k, H)
            logp = torch.log_softmax(self._logits(g_f), dim=-1)
            ctop = logp.topk(k, dim=-1)  # (R, k, k) children of each frontier node
            cand_score = (score.gather(1, frontier)[:, :, None] + ctop.values).reshape(R, k * k)
            base = tok.shape[1]
            tok = torch.cat([tok, self._tokens(ctop.indices).reshape(R, k * k)], dim=1)
            par = torch.cat([par, frontier[:, :, None].expand(R, k, k).reshape(R, k * k)], dim=1)
            score = torch.cat([score, cand_score], dim=1)
            dep = torch.cat([dep, torch.full((R, k * k), d + 1, dtype=torch.int64, device=dev)], dim=1)
            # the next frontier: the k best new candidates by path probability
            best = cand_score.topk(k, dim=-1).indices  # (R, k) among the k * k
            slot = best // k  # which frontier node is the parent (its expanded slot: n_exp + slot)
            frontier = base + best
            parent_g = g_f.gather(1, slot[:, :, None].expand(R, k, g_f.shape[-1]))
            anc = anc.gather(1, slot[:, :, None].expand(R, k, anc.shape[2]))
        return self._select(roots, run, depth, tok.cpu(), par.cpu(), score.cpu(), dep.cpu())

    def _fused_chain(self, state: dict, roots, run, depth, D: int) -> Draft:
        """``propose``'s chain (top-1 at each depth) through ``_fused_step``: the pool of nodes
        the tree loop builds with top_k = 1, handed to ``_select``; with a tree budget it
        stops at the depth where no sequence could keep a deeper node (``_chain_wants_more``)."""
        E = self.model.tok_embeddings.weight
        R, dev = len(run), E.device
        g, total = state["g"], torch.zeros(len(run), device=dev)
        toks, scores = [torch.tensor([roots[b] for b in run], device=dev)], [total]
        for d in range(1, D + 1):
            top = torch.log_softmax(self._logits(g[:, 0]), dim=-1).topk(1, dim=-1)
            total = total + top.values[:, 0]
            toks.append(self._tokens(top.indices[:, 0]))
            scores.append(total)
            if d < D and not self._chain_wants_more(run, depth, torch.stack(scores[1:], 1)):
                D = d  # no sequence would keep a deeper node
            if d < D:
                g = self._fused_step(state, self.head.inputs(g, E[toks[-1]][:, None]))
            else:
                break
        tok, score = torch.stack(toks, 1), torch.stack(scores, 1)
        par = torch.arange(-1, D, device=dev).expand(R, D + 1)
        dep = torch.arange(0, D + 1, device=dev).expand(R, D + 1)
        return self._select(roots, run, depth, tok.cpu(), par.cpu(), score.cpu(), dep.cpu())

    def _chain_wants_more(self, run: List[int], depth: List[int], scores: torch.Tensor) -> bool:
        """Whether any running sequence could keep a node deeper than its d nodes so far
        (scores (R, d): their log path probabilities; ``TreeBudget.wants_more`` up to its
        depth); True without a budget.  A sequence's kept nodes do not depend on whether
        another one kept the drafting going (``wants_more`` never stops short of them)."""
        if self.budget is None:
            return True
        values = scores.exp().tolist()
        return any(self.budget.wants_more(b, values[r], depth[b]) for r, b in enumerate(run))

    def _fused_layer(self) -> Optional[tuple]:
        """``specdec_engine::decoder_layer``'s weight arguments for the head's layer (one row per sequence
        and step), or None where it runs the head's Python ops: the target layers' rule
        (``model.fused_layer_args``), the norms float32 on CPU too."""
        head = self.head
        return fused_layer_args(
            self, (head.wqkv, head.wo, head.w13, head.w2), head.numerics, 1, norms=(head.attention_norm, head.ffn_norm)
        )

    def _chain_start(self, run: List[int]) -> Optional[dict]:
        """A chain's state for the sequences ``run`` when the head's layer runs in one native call
        per draft step (``_fused_layer``), else None: their committed keys and values in
        right-padded caches [R, nkv, S + max_depth, hd] with their lengths, and ``g``, the head's
        output at each root (R, 1, H, from ``_ingest``); the first draft step is at position
        end + 1."""
        fused = self._fused_layer()
        if fused is None or any(self._keys[b].dtype != torch.float32 for b in run):
            return None
        head = self.head
        n = [self._keys[b].shape[0] for b in run]
        k_cache = torch.zeros(len(run), head.num_kv_heads, max(n) + self.max_depth, head.head_dim)
        v_cache = torch.zeros_like(k_cache)
        for r, b in enumerate(run):
            k_cache[r, :, : n[r]] = self._keys[b].transpose(0, 1)
            v_cache[r, :, : n[r]] = self._values[b].transpose(0, 1)
        state = {
            "fused": fused,
            "k": k_cache,
            "v": v_cache,
            "lens": torch.tensor(n, dtype=torch.int32),
            "ends": torch.tensor([self._end[b] for b in run]),
            "depth": 1,
            "g": torch.stack([self._root[b] for b in run])[:, None],
        }
        return state

    def _fused_step(self, state: dict, u: torch.Tensor) -> torch.Tensor:
        """The head's layer on one row per sequence, u (R, 1, H) at position end + depth, in one
        ``specdec_engine::decoder_layer`` call (the ops of ``project``, ``attend`` and ``finish``; the
        row attends to the cache's first lens + 1 slots, its own written last): g (R, 1, H)."""
        if int(state["lens"].max()) >= state["k"].shape[2]:  # extended past max_depth (an ensemble's longer
            # chain keeps asking, as the Python ops allow): room for max_depth more steps
            more = torch.zeros(*state["k"].shape[:2], self.max_depth, state["k"].shape[3])
            state["k"], state["v"] = torch.cat([state["k"], more], 2), torch.cat([state["v"], more], 2)
        cos, sin = self.head.rotary((state["ends"] + state["depth"])[:, None], torch.float32)
        g = self._layer_call(u, cos, sin, state["k"], state["v"], state["lens"], state["fused"])
        state["lens"] = state["lens"] + 1
        state["depth"] += 1
        return g

    def _layer_call(self, u, cos, sin, k_cache, v_cache, lens, fused) -> torch.Tensor:
        """``specdec_engine::decoder_layer`` with the head's layer: u (B, N, H) written after lens[b]
        slots of the caches [B, nkv, S, hd], causal within the block: the outputs (B, N, H)."""
        head = self.head
        return torch.ops.specdec_engine.decoder_layer(
            u.contiguous(),
            head.attention_norm,
            head.ffn_norm,
            head.eps,
            cos,
            sin,
            k_cache,
            v_cache,
            lens,
            None,
            None,
            *fused,
            head.num_heads,
            head.num_kv_heads,
            packed.isa_code(None),
        )

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """The head's logits over the draft vocabulary: (..., Vd) float32 from g (..., H)."""
        return linear(g.to(self._W_draft.dtype), self._W_draft, self.head.numerics).float()

    def _root_outputs(self, run: List[int]):
        """For the sequences ``run``: the committed keys and values (left-padded to the
        longest, (R, S, nkv, hd)), their validity (R, S) and the head's output at each root
        query (R, 1, H), computed by ``_ingest``."""
        head, E = self.head, self.model.tok_embeddings.weight
        R, S = len(run), max(self._keys[b].shape[0] for b in run)
        ctx_k = torch.zeros(R, S, head.num_kv_heads, head.head_dim, dtype=E.dtype, device=E.device)
        ctx_v = torch.zeros_like(ctx_k)
        ctx_ok = torch.zeros(R, S, dtype=torch.bool, device=E.device)
        for r, b in enumerate(run):
            n = self._keys[b].shape[0]
            ctx_k[r, S - n :], ctx_v[r, S - n :], ctx_ok[r, S - n :] = self._keys[b], self._values[b], True
        return ctx_k, ctx_v, ctx_ok, torch.stack([self._root[b] for b in run])[:, None]

    # ------------------------------------------------------------------ chain distributions
    @torch.inference_mode()
    def chain_begin(self, histories, num_draft_tokens, active, vocab_size):
        """The head's distribution of the first draft token (``Drafter.chain_begin``)."""
        B = len(histories)
        ready = [bool(active[b]) and int(num_draft_tokens[b]) >= 1 and self._ingest(b, histories[b]) for b in range(B)]
        self._chain_ks = [min(int(k), self.max_depth) if r else 0 for k, r in zip(num_draft_tokens, ready)]
        self._chain_run = [b for b in range(B) if ready[b]]
        probs = torch.zeros(B, vocab_size)
        if not self._chain_run:
            return probs, torch.zeros(B, dtype=torch.bool)
        with torch.inference_mode():
            self._chain = self._chain_start(self._chain_run)
            if self._chain is None:
                ctx_k, ctx_v, ctx_ok, g = self._root_outputs(self._chain_run)
                self._chain = {"k": ctx_k, "v": ctx_v, "ok": ctx_ok, "g": g, "depth": 0}
        g = self._chain["g"]
        probs[self._chain_run] = self._full(draft_distribution(self._logits(g[:, 0]), self.sampling)).cpu()
        return probs, torch.tensor(ready)

    @torch.inference_mode()
    def chain_extend(self, tokens):
        """Feed the chain's token at depth d with the head's own feature and return the
        distribution of depth d + 1 (``Drafter.chain_extend``)."""
        B = len(self._chain_ks)
        probs = torch.zeros(B, self.vocab_size)
        if not self._chain_run:
            return probs, torch.zeros(B, dtype=torch.bool)
        c = self._chain
        run, head, E = self._chain_run, self.head, self.model.tok_embeddings.weight
        tok = tokens.to(E.device)[torch.tensor(run, device=E.device)]
        u = head.inputs(c["g"], E[tok][:, None])
        if "fused" in c:  # one native call (``_chain_start``)
            c["g"] = self._fused_step(c, u)
            probs[run] = self._full(draft_distribution(self._logits(c["g"][:, 0]), self.sampling)).cpu()
            return probs, torch.tensor([k >= c["depth"] for k in self._chain_ks])
        c["depth"] += 1
        d = c["depth"]
        q, k, v = head.project(u, torch.tensor([[self._end[b] + d] for b in run], device=E.device))
        c["k"], c["v"] = torch.cat([c["k"], k], 1), torch.cat([c["v"], v], 1)
        c["ok"] = torch.cat([c["ok"], torch.ones(len(run), 1, dtype=torch.bool, device=E.device)], 1)
        c["g"] = head.finish(u, head.attend(q, c["k"], c["v"], c["ok"][:, None]))
        probs[run] = self._full(draft_distribution(self._logits(c["g"][:, 0]), self.sampling)).cpu()
        return probs, torch.tensor([k >= d + 1 for k in self._chain_ks])

    def _select(self, roots, run, depth, tok, par, score, dep) -> Draft:
        """Rerank each running sequence's pool by path probability (ties: shallower first),
        keep the best ``n - 1`` no deeper than its depth (n: the budget's choice, else
        ``max_nodes``), in topological order."""
        trees = [([r], [-1]) for r in roots]
        self.path_logprobs = [[0.0] for _ in roots]
        for r, b in enumerate(run):
            n = tok.shape[1]
            ok = (dep[r] <= depth[b]) & (torch.arange(n) > 0)
            ids = ok.nonzero()[:, 0].tolist()
            ids.sort(key=lambda i: (-float(score[r, i]), int(dep[r, i]), i))
            n_keep = self.max_nodes
            if self.budget is not None:
                values = [math.exp(float(score[r, i])) for i in ids[: self.max_nodes - 1]]
                n_keep = self.budget.choose(b, values)
                self.budget.kept(b, values[: n_keep - 1])
            keep = sorted(ids[: n_keep - 1], key=lambda i: (int(dep[r, i]), -float(score[r, i]), i))
            where = {0: 0}
            t, p = [roots[b]], [-1]
            for i in keep:
                where[i] = len(t)
                t.append(int(tok[r, i]))
                p.append(where[int(par[r, i])])  # the parent is kept and earlier (prefix-closed)
            trees[b] = (t, p)
            self.path_logprobs[b] = [0.0] + [float(score[r, i]) for i in keep]
        draft = Draft.from_lists(trees, is_chain=None)  # on the host: the loop moves it, reading nothing back
        if not self.tree:
            draft.is_chain = all(list(p) == chain_parents(len(p)) for _, p in trees)
        return draft
