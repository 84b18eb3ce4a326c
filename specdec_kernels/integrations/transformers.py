"""Speculative decoding with our kernels for any Hugging Face transformers causal LM.

Two layers:

1. **An attention implementation**, ``"specdec_tree"`` (``ATTENTION_NAME``), registered in
   ``transformers.AttentionInterface`` (and a mask function in ``AttentionMaskInterface``)
   when this module is imported.  Inside a forward run by ``HFCausalLM`` it writes each
   layer's new keys and values into a dense KV cache that we manage (layout
   ``[L, 2, B, Hkv, S, D]``, the layout of ``compact_kv_cache``) and attends with
   ``specdec_kernels.tree_attention``: a whole token tree is scored in one forward, the tree's
   ancestor mask handed over through our own context (a ``contextvars.ContextVar``, never
   through transformers' mask machinery) and the rotary positions given as ``position_ids``
   (``cache_seqlens + depth``).  Any model whose attention goes through
   ``ALL_ATTENTION_FUNCTIONS.get_interface`` (Llama, Qwen2, Mistral, Gemma, Phi-3, ...) works
   unchanged.  Outside such a forward the implementation behaves exactly as transformers'
   ``"sdpa"`` (transformers' own cache and masks), so a model left on it still runs
   ``generate`` normally.

2. **A generate-level drop-in**, ``speculative_generate(model, input_ids, ...)``: the
   arguments transformers users know from ``model.generate`` (``attention_mask`` with left
   padding, ``assistant_model=``, ``prompt_lookup_num_tokens=``, ``max_new_tokens``,
   ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``, ``pad_token_id``)
   and the output of ``generate`` (prompt plus new tokens, finished rows padded).  It runs
   the package's decode loop (``specdec_kernels.decoding.SpeculativeDecoder``) over
   ``HFCausalLM``: drafts (prompt lookup / n-gram, chains or trees; an assistant model with
   its own cache, chains or static trees), one target forward per step, verification with
   ``verify_greedy`` / ``verify_tree_greedy`` at temperature 0 and lossless
   ``rejection_sample`` / ``tree_rejection_sample`` on ``sampling_probs`` otherwise
   (Leviathan et al. 2023; Chen et al. 2023; SpecInfer, Miao et al. 2024), the accepted path
   compacted in place with ``compact_kv_cache``.

Exactness.  Greedy output equals ``model.generate(do_sample=False)`` token for token
(up to floating-point ties of the argmax: our attention rounds like SDPA, not bit for bit).
Padding is never attended: the left padding is stripped and each sequence lives in the cache
at its own length (``cache_seqlens``).  What the kernel cannot reproduce raises instead of
running a different model: a sliding window shorter than the sequence, attention
soft-capping, attention sinks, non-causal attention, dropout, layers whose attention does not
go through the interface (recurrent / hybrid models), head dims ``tree_attention`` lacks.

Example::

    from specdec_kernels.integrations.transformers import speculative_generate

    out = speculative_generate(model, input_ids, attention_mask=mask, prompt_lookup_num_tokens=8,
                               max_new_tokens=128)          # == model.generate(..., do_sample=False)
    out = speculative_generate(model, input_ids, assistant_model=small, tree=(2, 2), max_new_tokens=128)
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Set, Tuple, Union

import torch

from specdec_kernels import SUPPORTED_HEAD_DIMS, tree_attention
from specdec_kernels._optional import TRANSFORMERS_INTEGRATION_MIN, require
from specdec_kernels.decoding.draft import Drafter, NoDrafter, SamplingParams
from specdec_kernels.decoding.drafters.model_drafter import ModelDrafter
from specdec_kernels.decoding.drafters.ngram import NgramDrafter
from specdec_kernels.decoding.engine.adaptive import DraftLengthPolicy
from specdec_kernels.decoding.engine.loop import SpeculativeDecoder
from specdec_kernels.decoding.engine.stats import DecodeStats

# a missing or too old transformers is named here, not by a failed import below
transformers = require(
    "transformers",
    purpose="specdec_kernels.integrations.transformers",
    extra="transformers",
    min_version=TRANSFORMERS_INTEGRATION_MIN,
)
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

ATTENTION_NAME = "specdec_tree"
DEFAULT_TREE_WIDTHS = (2, 2)  # assistant-model trees with tree=True: 2 children at depths 1 and 2
DEFAULT_ASSISTANT_TOKENS = 5  # draft depth K of an assistant model when num_draft_tokens is None

__all__ = [
    "ATTENTION_NAME",
    "HFCausalLM",
    "register",
    "specdec_tree_attention",
    "speculative_generate",
    "unsupported_model",
]


# --------------------------------------------------------------------------------------
# The attention implementation
# --------------------------------------------------------------------------------------
@dataclass
class _Forward:
    """What one ``HFCausalLM`` forward hands to the attention function of every layer."""

    kv_cache: torch.Tensor  # [L, 2, B, Hkv, S, D]
    cache_seqlens: torch.Tensor  # (B,) int32 on the model's device
    tree_mask: Optional[torch.Tensor]  # bool (N, N) / (B, N, N), or None (causal chain)
    starts: List[int]  # cache_seqlens on the CPU
    backend: Optional[str]
    layers_seen: Set[int] = field(default_factory=set)


_CURRENT: contextvars.ContextVar[Optional[_Forward]] = contextvars.ContextVar("specdec_tree_forward", default=None)


def specdec_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """The ``"specdec_tree"`` attention function (transformers' ``AttentionInterface``
    signature).

    Inside an ``HFCausalLM`` forward: writes ``key`` / ``value`` of the block's N new tokens at
    slots ``cache_seqlens[b] + i`` of layer ``module.layer_idx`` of our KV cache, then returns
    ``tree_attention(query, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale=scaling)``:
    every new token sees its sequence's cached prefix and its ancestors in the block.
    ``attention_mask`` is ignored there (our mask function returns None inside the forward;
    padding never reaches the cache).  Outside: ``sdpa_attention_forward`` unchanged.

    Args:
        module: the attention layer (``layer_idx``, ``is_causal`` are read).
        query: (B, H, N, D); key, value: (B, Hkv, N, D) (after RoPE; transformers' own cache
            is not used inside our forward, so these are the new tokens only).
        attention_mask: transformers' mask (unused inside our forward).
        kwargs: ``scaling`` (softmax scale, default D ** -0.5), ``dropout``,
            ``sliding_window``, ``softcap``, ``s_aux`` (checked), others ignored.

    Returns:
        (attn_output (B, N, H, D) in query's dtype, None).

    Raises:
        ValueError: inside our forward, a setting the kernel cannot reproduce exactly: dropout
            > 0, attention soft-capping, attention sinks, non-causal attention, a sliding window
            shorter than the attended length, a layer shape that differs from the cache's.
    """
    step = _CURRENT.get()
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layer = getattr(module, "layer_idx", None)
    if kwargs.get("dropout", 0.0):
        raise ValueError(f"{ATTENTION_NAME}: attention dropout {kwargs['dropout']} (call model.eval())")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{ATTENTION_NAME}: attention soft-capping (softcap={kwargs['softcap']}) is not implemented")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{ATTENTION_NAME}: attention sinks (s_aux) are not implemented")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError(f"{ATTENTION_NAME}: non-causal attention (layer {layer}) is not supported")
    B, H, N, D = query.shape
    window = kwargs.get("sliding_window")
    if window is not None and max(step.starts) + N > window:
        raise ValueError(
            f"{ATTENTION_NAME}: layer {layer} has a sliding window of {window} tokens, shorter than the "
            f"{max(step.starts) + N} attended: sliding-window attention is not implemented"
        )
    cache = step.kv_cache
    if not isinstance(layer, int) or not 0 <= layer < cache.shape[0]:
        raise ValueError(f"{ATTENTION_NAME}: attention layer_idx {layer!r} outside the cache's {cache.shape[0]} layers")
    if key.shape[1] != cache.shape[3] or key.shape[3] != cache.shape[5] or key.shape[0] != B or key.shape[2] != N:
        raise ValueError(
            f"{ATTENTION_NAME}: layer {layer} keys of shape {tuple(key.shape)} do not fit the KV cache "
            f"[L, 2, B, Hkv={cache.shape[3]}, S, D={cache.shape[5]}]"
        )
    k_cache, v_cache = cache[layer, 0], cache[layer, 1]  # [B, Hkv, S, D]
    if min(step.starts) == max(step.starts):
        s = step.starts[0]
        k_cache[:, :, s : s + N] = key
        v_cache[:, :, s : s + N] = value
    else:
        b_idx = torch.arange(B, device=key.device)[:, None]
        slots = step.cache_seqlens.to(torch.int64)[:, None] + torch.arange(N, device=key.device)
        k_cache[b_idx, :, slots] = key.transpose(1, 2)
        v_cache[b_idx, :, slots] = value.transpose(1, 2)
    q = query.transpose(1, 2).contiguous()  # (B, N, H, D)
    out = tree_attention(
        q,
        k_cache,
        v_cache,
        step.cache_seqlens,
        step.tree_mask,
        sm_scale=kwargs.get("scaling"),
        backend=step.backend,
        validate=False,
    )
    step.layers_seen.add(layer)
    return out, None


def _specdec_tree_mask(*args, **kwargs):
    """The mask function of ``"specdec_tree"``: none inside our forward (our tree mask and
    ``cache_seqlens`` say what each token sees), transformers' SDPA mask outside."""
    if _CURRENT.get() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register ``"specdec_tree"`` in transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface`` (done when this module is imported; idempotent).

    Returns:
        The implementation's name, for ``model.set_attn_implementation(name)`` or
        ``from_pretrained(..., attn_implementation=name)``.
    """
    AttentionInterface.register(ATTENTION_NAME, specdec_tree_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _specdec_tree_mask)
    return ATTENTION_NAME


register()


# --------------------------------------------------------------------------------------
# A transformers model behind the decode engine's model interface
# --------------------------------------------------------------------------------------
def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _head_dim(config) -> Optional[int]:
    heads = getattr(config, "num_attention_heads", None)
    hd = getattr(config, "head_dim", None)
    if hd is None and heads and getattr(config, "hidden_size", None):
        hd = config.hidden_size // heads
    return hd


def unsupported_model(model) -> List[str]:
    """Why ``HFCausalLM`` (and so ``speculative_generate``) cannot run a transformers model
    exactly: [] when it can (as far as the config tells; layers whose attention bypasses the
    interface are caught at the first forward).

    Returns:
        One line per problem, naming the setting.
    """
    problems: List[str] = []
    if not isinstance(model, transformers.PreTrainedModel):
        return [f"not a transformers PreTrainedModel ({type(model).__name__})"]
    config = _text_config(model)
    if getattr(model.config, "is_encoder_decoder", False):
        problems.append("is_encoder_decoder=True (only decoder-only causal LMs)")
    if not type(model)._can_set_attn_implementation():
        problems.append(f"{type(model).__name__} does not route its attention through transformers' AttentionInterface")
    for name in ("num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(getattr(config, name, None), int):
            problems.append(f"config.{name} missing")
    hd = _head_dim(config)
    if hd not in SUPPORTED_HEAD_DIMS:
        problems.append(f"head_dim {hd} (tree_attention supports {SUPPORTED_HEAD_DIMS})")
    for name in ("attn_logit_softcapping",):
        if getattr(config, name, None) is not None:
            problems.append(f"{name}={getattr(config, name)} (attention soft-capping is not implemented)")
    if not getattr(config, "is_causal", True):
        problems.append("is_causal=False (bidirectional attention)")
    kinds = sorted(
        {t for t in (getattr(config, "layer_types", None) or []) if t not in ("full_attention", "sliding_attention")}
    )
    if kinds:
        problems.append(
            f"layer_types {kinds} (only attention layers; recurrent / linear-attention layers are not supported)"
        )
    return problems


@dataclass
class TargetArgs:
    """The shape of a transformers causal LM as the decode engine reads it (``model.args``)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int


class HFCausalLM:
    """A transformers causal LM with the call interface of ``specdec_kernels.decoding.Transformer``
    (what ``SpeculativeDecoder`` and ``ModelDrafter`` use), attending through ``"specdec_tree"``.

    Construction switches the model's attention implementation to ``"specdec_tree"`` (which
    behaves as ``"sdpa"`` outside our forwards); ``restore()`` (or leaving the ``with`` block)
    puts the previous one back.

    Args:
        model: a transformers ``*ForCausalLM`` (decoder-only, attention through
            ``AttentionInterface``; ``unsupported_model`` lists what is refused).
        attention_backend: ``tree_attention``'s backend (None: automatic; "torch", "triton",
            "reference").

    Raises:
        TypeError: model is not a transformers ``PreTrainedModel``.
        ValueError: a model this path cannot run exactly (``unsupported_model``).
    """

    _specdec_decode_target = True  # SpeculativeDecoder accepts it as a target model

    def __init__(self, model, *, attention_backend: Optional[str] = None):
        if not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(
                f"model must be a transformers PreTrainedModel (a *ForCausalLM), got {type(model).__name__}"
            )
        problems = unsupported_model(model)
        if problems:
            raise ValueError(f"{type(model).__name__} cannot be verified with {ATTENTION_NAME}: " + "; ".join(problems))
        self.hf = model
        config = _text_config(model)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.args = TargetArgs(
            vocab_size=config.vocab_size,
            hidden_size=getattr(config, "hidden_size", 0),
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_head_dim(config),
            max_position=int(getattr(config, "max_position_embeddings", None) or 2**31 - 1),
        )
        self.attention_backend = attention_backend
        self._previous = model.config._attn_implementation
        if self._previous != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
        self._restored = False

    def restore(self) -> None:
        """Put the model's previous attention implementation back (idempotent)."""
        if not self._restored and self._previous != ATTENTION_NAME:
            self.hf.set_attn_implementation(self._previous)
        self._restored = True

    def __enter__(self) -> "HFCausalLM":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype

    def new_kv_cache(self, batch: int, capacity: int, num_layers: Optional[int] = None) -> torch.Tensor:
        """A zeroed KV cache ``[L, 2, batch, Hkv, capacity, D]`` in the model's dtype and device."""
        a = self.args
        L = a.num_layers if num_layers is None else num_layers
        return torch.zeros(L, 2, batch, a.num_kv_heads, capacity, a.head_dim, dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        tree_mask: Optional[torch.Tensor] = None,
        *,
        num_layers: Optional[int] = None,
        logit_rows: Optional[torch.Tensor] = None,
        return_hidden: bool = False,
        compute_logits: bool = True,
    ) -> Optional[torch.Tensor]:
        """Feed a block of N new tokens per sequence; return their next-token logits (the
        contract of ``Transformer.forward``).

        Args:
            tokens: (B, N) int64: the block (for verification: root then drafts).
            positions: (B, N) int64 rotary positions (``cache_seqlens + depth``), passed as
                transformers' ``position_ids``.
            kv_cache: (L, 2, B, Hkv, S, D) from ``new_kv_cache``; the block's K/V are written at
                slots ``cache_seqlens[b] + i``.
            cache_seqlens: (B,) int32, tokens already cached per sequence; + N <= S.
            tree_mask: bool (N, N) / (B, N, N) ancestor mask of the block, None = chain.
            num_layers: None or all the layers (layer skipping is not available here).
            logit_rows: (B, R) int64: logits of these block rows only (R = 0: none).
            compute_logits: False: run for the cache writes only, return None.

        Returns:
            (B, N or R, vocab) float32 logits, or None (R = 0, compute_logits False).

        Raises:
            ValueError: num_layers below the model's layers, return_hidden, a cache that does not
                fit, a layer whose attention did not go through the interface.
        """
        if num_layers is not None and num_layers != self.args.num_layers:
            raise ValueError(
                f"num_layers={num_layers}: a transformers model runs all its {self.args.num_layers} layers here"
            )
        if return_hidden:
            raise ValueError(
                "return_hidden is not available for transformers models (drafters that want hidden states)"
            )
        B, N = tokens.shape
        starts = cache_seqlens.tolist()
        if kv_cache.dim() != 6 or kv_cache.shape[0] < self.args.num_layers or kv_cache.shape[2] != B:
            raise ValueError(
                f"kv_cache must have shape (L={self.args.num_layers}, 2, B={B}, Hkv, S, D), got {tuple(kv_cache.shape)}"
            )
        if B and max(starts) + N > kv_cache.shape[4]:
            raise ValueError(f"cache_seqlens + N ({max(starts) + N}) exceed the cache's {kv_cache.shape[4]} slots")
        rows = None
        keep: Union[int, torch.Tensor] = 0  # transformers' logits_to_keep: 0 = all rows
        no_logits = not compute_logits or (logit_rows is not None and logit_rows.shape[1] == 0)
        if no_logits:
            keep = 1  # the head on one row only, discarded
        elif logit_rows is not None:
            wanted = torch.unique(logit_rows)  # sorted
            keep = wanted.to(tokens.device)
            rows = torch.searchsorted(wanted, logit_rows.to(wanted.device).contiguous())
        step = _Forward(kv_cache, cache_seqlens.to(torch.int32), tree_mask, starts, self.attention_backend)
        if self.hf.config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(
                f"the model's attention implementation was changed to {self.hf.config._attn_implementation!r} "
                f"while an HFCausalLM uses it (it must stay {ATTENTION_NAME!r})"
            )
        token = _CURRENT.set(step)
        try:
            out = self.hf(
                input_ids=tokens, position_ids=positions, use_cache=False, logits_to_keep=keep, return_dict=True
            )
        finally:
            _CURRENT.reset(token)
        if len(step.layers_seen) != self.args.num_layers:
            missing = sorted(set(range(self.args.num_layers)) - step.layers_seen)
            raise ValueError(
                f"layers {missing[:8]} of {type(self.hf).__name__} did not attend through {ATTENTION_NAME} "
                "(their attention bypasses transformers' AttentionInterface): cannot verify trees with it"
            )
        if no_logits:
            return None
        logits = out.logits.float()
        if rows is not None:
            logits = logits.gather(1, rows.to(logits.device)[..., None].expand(-1, -1, logits.shape[-1]))
        return logits


# --------------------------------------------------------------------------------------
# speculative_generate
# --------------------------------------------------------------------------------------
def _token_list(name: str, value) -> List[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise TypeError(f"{name} must be an int, a list of ints or None, got {type(value).__name__}")
    values = [value] if isinstance(value, int) else list(value)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise TypeError(f"{name} must hold ints, got {values!r}")
    return values


def _check_int(name: str, value, low: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _prompts(input_ids, attention_mask, pad_token_id, stops, vocab: int) -> List[List[int]]:
    """Left-padded ids and mask -> the real tokens of each row."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.LongTensor of shape (batch, length), got {type(input_ids).__name__}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must have shape (batch >= 1, length >= 1), got {tuple(input_ids.shape)}")
    ids = input_ids.cpu().to(torch.int64)
    if attention_mask is None:
        # as generate: padding is inferred from pad_token_id when it is not the EOS token
        if pad_token_id is not None and pad_token_id not in stops and bool((ids == pad_token_id).any()):
            mask = ids != pad_token_id
        else:
            mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
            )
        m = attention_mask.cpu()
        if not bool(((m == 0) | (m == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (tokens) only")
        mask = m.bool()
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError(
            "attention_mask: only left padding is supported (a row has a token before a padding slot); "
            "tokenize with padding_side='left', as generate expects"
        )
    if not bool(mask.any(dim=1).all()):
        raise ValueError("attention_mask: every row needs at least one token")
    prompts = [row[m].tolist() for row, m in zip(ids, mask)]
    for b, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"input_ids row {b} holds token ids outside [0, {vocab})")
    return prompts


def speculative_generate(
    model,
    input_ids: torch.Tensor,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    assistant_model=None,
    prompt_lookup_num_tokens: Optional[int] = None,
    max_matching_ngram_size: Optional[int] = None,
    drafter: Optional[Drafter] = None,
    tree: Union[None, bool, Sequence[int]] = None,
    num_draft_tokens: Union[None, int, DraftLengthPolicy] = None,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    eos_token_id: Union[None, int, Sequence[int]] = None,
    pad_token_id: Optional[int] = None,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    attention_backend: Optional[str] = None,
    return_stats: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, DecodeStats]]:
    """Speculative decoding of a transformers causal LM with our tree attention and
    verification ops: a drop-in for ``model.generate`` with ``assistant_model=`` or
    ``prompt_lookup_num_tokens=`` (any batch size, left padding, chains or token trees).

    Drafts come from exactly one source (none: plain decoding through our kernels):
    ``prompt_lookup_num_tokens`` (prompt lookup decoding, Saxena 2023: our ``NgramDrafter``),
    ``assistant_model`` (a smaller transformers model with the same vocabulary, run through
    ``"specdec_tree"`` with its own KV cache: Leviathan et al. 2023) or ``drafter`` (any
    ``specdec_kernels.decoding.Drafter`` that needs no hidden states).  Each step the target
    scores the root and all drafts in one forward; greedy runs keep the longest path the
    target's argmax agrees with (``verify_greedy`` / ``verify_tree_greedy``), sampling runs use
    lossless rejection sampling (``rejection_sample`` / ``tree_rejection_sample``) on
    ``sampling_probs(logits, temperature, top_k, top_p)``; the accepted nodes' K/V are
    compacted in place (``compact_kv_cache``).

    Args:
        model: the target, a transformers ``*ForCausalLM`` (see ``unsupported_model``).  Its
            attention implementation is switched to ``"specdec_tree"`` during the call and
            restored after.
        input_ids: (B, P) integer token ids, left-padded when the prompts differ in length.
        attention_mask: (B, P) 0/1, 0 on the left padding; None: all tokens, or (as
            ``generate``) ``input_ids != pad_token_id`` when pad_token_id is given, occurs in
            input_ids and is not an EOS token.
        assistant_model: a transformers causal LM with the target's vocabulary size.
        prompt_lookup_num_tokens: >= 1: draft this many tokens (K) by prompt lookup.
        max_matching_ngram_size: prompt lookup's longest suffix match (default 5).
        drafter: a ``Drafter`` instance instead (e.g. ``NgramDrafter(tree=True, max_chains=4)``).
        tree: None / False: chains.  True: token trees (prompt lookup: up to 2 matches merged;
            assistant: children per node ``DEFAULT_TREE_WIDTHS``).  A sequence of ints
            (assistant only): the static tree's children per node by depth, e.g. (3, 2, 1).
        num_draft_tokens: draft depth K per step: an int >= 0, or a ``DraftLengthPolicy``
            (e.g. ``specdec_kernels.decoding.CostModelPolicy(0, 8)``) choosing K every step.
            None: ``prompt_lookup_num_tokens`` for prompt lookup, ``DEFAULT_ASSISTANT_TOKENS``
            for an assistant model or a drafter.
        max_new_tokens: >= 0 tokens to generate per row at most (EOS included).
        do_sample: False: greedy (the output equals ``model.generate(do_sample=False)``).
            True: sample from ``sampling_probs`` with temperature / top_k / top_p (the
            generation config's sampling defaults are not read).
        temperature: > 0, with do_sample.
        top_k: None or 0 (off), or >= 1.
        top_p: None (off) or in (0, 1].
        eos_token_id: an int or ints that end a row (emitted, then the row stops); None: the
            model's generation config; [] : none.
        pad_token_id: fills finished rows; None: the generation config's, else the first EOS,
            else 0.
        seed: sampling seed; row b draws from its own generator seeded ``seed + b`` (its tokens
            do not depend on the rest of the batch).
        generator: a ``torch.Generator`` to draw the seed from instead (not with seed).
        attention_backend: ``tree_attention`` backend (None: automatic).
        return_stats: also return the run's ``DecodeStats`` (target passes, acceptance, times).

    Returns:
        (B, P + T) int64 on input_ids' device: input_ids followed by the new tokens, T the
        longest row's new tokens; rows that stopped earlier are padded with pad_token_id
        (the layout of ``generate``'s output).  With ``return_stats``: (tokens, stats).

    Raises:
        TypeError: model / assistant_model not transformers models, input_ids not an integer
            tensor, drafter not a Drafter, an argument of the wrong type (the message names it).
        ValueError: more than one draft source, prompt_lookup_num_tokens < 1, right padding,
            token ids outside the vocabulary, an assistant with another vocabulary size,
            temperature <= 0 with do_sample, top_k < 0, top_p outside (0, 1], seed with
            generator, a tree form that does not fit the draft source, prompts plus
            max_new_tokens longer than the model's positions or its sliding window, a model
            ``unsupported_model`` refuses.

    Example::

        out = speculative_generate(model, batch.input_ids, attention_mask=batch.attention_mask,
                                   prompt_lookup_num_tokens=8, max_new_tokens=64)
        texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    """
    # ---- arguments, all checked before any model work
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model must be a transformers causal LM (PreTrainedModel), got {type(model).__name__}")
    sources = [
        n
        for n, v in (
            ("assistant_model", assistant_model),
            ("prompt_lookup_num_tokens", prompt_lookup_num_tokens),
            ("drafter", drafter),
        )
        if v is not None
    ]
    if len(sources) > 1:
        raise ValueError(f"give at most one draft source, got {' and '.join(sources)}")
    if assistant_model is not None and not isinstance(assistant_model, transformers.PreTrainedModel):
        raise TypeError(
            f"assistant_model must be a transformers causal LM (PreTrainedModel), got {type(assistant_model).__name__}"
        )
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a specdec_kernels.decoding.Drafter, got {type(drafter).__name__}")
    if drafter is not None and getattr(drafter, "wants_hidden", False):
        raise ValueError(
            f"drafter {getattr(drafter, 'name', type(drafter).__name__)!r} wants the target's hidden states, "
            "which this path does not provide"
        )
    _check_int("prompt_lookup_num_tokens", prompt_lookup_num_tokens, 1, allow_none=True)
    _check_int("max_matching_ngram_size", max_matching_ngram_size, 1, allow_none=True)
    if max_matching_ngram_size is not None and prompt_lookup_num_tokens is None:
        raise ValueError("max_matching_ngram_size needs prompt_lookup_num_tokens")
    _check_int("max_new_tokens", max_new_tokens, 0)
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {type(do_sample).__name__}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if do_sample and not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 with do_sample=True, got {temperature}")
    _check_int("top_k", top_k, 0, allow_none=True)
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise TypeError(f"top_p must be a number or None, got {type(top_p).__name__}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if seed is not None and generator is not None:
        raise ValueError("give seed or generator, not both")
    _check_int("seed", seed, 0, allow_none=True)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats must be a bool, got {type(return_stats).__name__}")
    if tree is not None and not isinstance(tree, bool):
        if isinstance(tree, (str, bytes)) or not hasattr(tree, "__iter__"):
            raise TypeError(
                f"tree must be None, a bool or a sequence of ints (children per depth), got {type(tree).__name__}"
            )
        tree = tuple(tree)
        if not tree or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in tree):
            raise ValueError(
                f"tree must be a non-empty sequence of ints >= 1 (children per node by depth), got {tree!r}"
            )
        if assistant_model is None:
            raise ValueError("tree as widths per depth needs assistant_model (prompt lookup takes tree=True)")
    if tree and drafter is not None:
        raise ValueError("tree: configure the drafter's own tree instead (e.g. NgramDrafter(tree=True))")
    if num_draft_tokens is not None and not isinstance(num_draft_tokens, DraftLengthPolicy):
        _check_int("num_draft_tokens", num_draft_tokens, 0)

    gen_config = getattr(model, "generation_config", None)
    stops = _token_list(
        "eos_token_id", eos_token_id if eos_token_id is not None else getattr(gen_config, "eos_token_id", None)
    )
    if pad_token_id is None:
        pad_token_id = getattr(gen_config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = stops[0] if stops else 0
    _check_int("pad_token_id", pad_token_id, 0)
    vocab = _text_config(model).vocab_size
    prompts = _prompts(input_ids, attention_mask, pad_token_id if attention_mask is None else None, stops, vocab)
    if stops and (min(stops) < 0 or max(stops) >= vocab):
        raise ValueError(f"eos_token_id must lie in [0, {vocab}), got {stops}")
    if assistant_model is not None:
        a_vocab = _text_config(assistant_model).vocab_size
        if a_vocab != vocab:
            raise ValueError(
                f"assistant_model's vocabulary ({a_vocab}) differs from the model's ({vocab}): "
                "speculative decoding needs the same tokenizer"
            )
        problems = unsupported_model(assistant_model)
        if problems:
            raise ValueError(f"assistant_model cannot run with {ATTENTION_NAME}: " + "; ".join(problems))
    problems = unsupported_model(model)
    if problems:
        raise ValueError(f"model cannot be verified with {ATTENTION_NAME}: " + "; ".join(problems))
    longest = max(len(p) for p in prompts) + max_new_tokens + 1
    for who, m in (("model", model), ("assistant_model", assistant_model)):
        window = getattr(_text_config(m), "sliding_window", None) if m is not None else None
        if isinstance(window, int) and longest > window:
            raise ValueError(
                f"{who} has a sliding window of {window} tokens, shorter than the prompt plus max_new_tokens "
                f"({longest}): sliding-window attention is not implemented"
            )

    if do_sample:
        sampling = SamplingParams(float(temperature), top_k or None, top_p)
    else:
        sampling = SamplingParams()
    if generator is not None:
        seed = int(torch.randint(0, 2**62, (), generator=generator))
    seeds = seed  # None: the engine draws one seed per row from torch's global generator

    # ---- the run
    B, P = input_ids.shape
    if max_new_tokens == 0:
        out = input_ids.clone()
        return (out, DecodeStats()) if return_stats else out
    target = HFCausalLM(model, attention_backend=attention_backend)
    assistant = None
    try:
        if prompt_lookup_num_tokens is not None:
            the_drafter: Drafter = NgramDrafter(max_matching_ngram_size or 5, tree=bool(tree))
            k = prompt_lookup_num_tokens
        elif assistant_model is not None:
            assistant = (
                target if assistant_model is model else HFCausalLM(assistant_model, attention_backend=attention_backend)
            )
            widths = None if not tree else (DEFAULT_TREE_WIDTHS if tree is True else tree)
            the_drafter = ModelDrafter(assistant, tree_widths=widths)
            k = DEFAULT_ASSISTANT_TOKENS
        elif drafter is not None:
            the_drafter, k = drafter, DEFAULT_ASSISTANT_TOKENS
        else:
            the_drafter, k = NoDrafter(), 0
        if num_draft_tokens is not None:
            k = num_draft_tokens
        decoder = SpeculativeDecoder(target, the_drafter, stop_token_ids=stops)
        result = decoder.generate(prompts, max_new_tokens, num_draft_tokens=k, sampling=sampling, seeds=seeds)
    finally:
        if assistant is not None and assistant is not target:
            assistant.restore()
        target.restore()

    T = max(len(t) for t in result.tokens)
    out = torch.full((B, P + T), pad_token_id, dtype=torch.int64)
    out[:, :P] = input_ids.cpu()
    for b, t in enumerate(result.tokens):
        out[b, P : P + len(t)] = torch.tensor(t, dtype=torch.int64)
    out = out.to(input_ids.device)
    return (out, result.stats) if return_stats else out
