"""The EAGLE draft head module (``EagleHead``): ``fc`` on [embedding; feature] and one Llama
decoder layer, with EAGLE-3's multi-layer feature fusion.

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

EAGLE-3 (Li et al. 2025) feeds the head more than the final hidden state: low-, mid- and
high-level features, the outputs of several target layers, fused by a linear layer into one
H-wide feature.  A head with ``feature_layers`` (l_1, ..., l_k) asks the engine for those
layers' outputs beside f_t (``Drafter.feature_layers``) and reads

    f'_t = W_fuse [f_t; n_1(h^{l_1}_t); ...; n_k(h^{l_k}_t)]

in place of f_t (n_i: an RMS norm with weights of its own, the residual streams' scales
differ by layer).  Only the committed positions have target features: deeper drafts still
read the head's own g.  ``with_feature_layers`` widens a head with W_fuse = [I 0 ... 0], which
drafts exactly as the head did, a starting point for fine-tuning.

The head's file format is ``eagle_format`` (``EagleHeadFile``, its base), its Q8_0
quantisation ``eagle_quant`` (``QuantizableHead``); the drafter that runs it, with EAGLE-2's
dynamic tree, is ``eagle.EagleDrafter``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from specdec_kernels.checks import integer_at_least, layer_indices
from specdec_kernels.decoding.drafters.eagle_format import EagleHeadFile
from specdec_kernels.decoding.drafters.eagle_quant import QuantizableHead
from specdec_kernels.decoding.model import Transformer, linear, rotate


class EagleHead(QuantizableHead, EagleHeadFile):
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
        self.token_ranking = None if ranking is None else check_token_ids(ranking, None, "ranking")

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


def check_token_ids(ids: Union[torch.Tensor, Sequence[int]], vocab_size: Optional[int], name: str) -> torch.Tensor:
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
