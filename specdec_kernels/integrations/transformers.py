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
   arguments of ``model.generate`` (a ``GenerationConfig`` and its fields, resolved by
   transformers as generate resolves them; ``attention_mask`` with left padding,
   ``assistant_model=``, ``prompt_lookup_num_tokens=``, ``assistant_early_exit=``, logits
   processors, stopping criteria, streamers; what cannot be honoured exactly is refused) and
   the output of ``generate`` (prompt plus new tokens, finished rows padded, or a
   ``GenerateDecoderOnlyOutput``); also a ``custom_generate`` loop for ``model.generate``
   (``_hf_generate.py`` holds the pieces).  It runs
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
    out = model.generate(**batch, custom_generate=speculative_generate, prompt_lookup_num_tokens=8)
"""

from __future__ import annotations

import contextvars
import copy
import threading
import weakref
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Set, Tuple, Union

import torch

from specdec_kernels import SUPPORTED_HEAD_DIMS, tree_attention
from specdec_kernels.checks import sampling_temperature, sampling_top_k, sampling_top_p
from specdec_kernels.decoding.draft import Drafter, NoDrafter, SamplingParams
from specdec_kernels.decoding.drafters.model_drafter import ModelDrafter
from specdec_kernels.decoding.drafters.ngram import NgramDrafter
from specdec_kernels.decoding.engine.adaptive import DraftLengthPolicy
from specdec_kernels.decoding.engine.loop import SpeculativeDecoder
from specdec_kernels.decoding.engine.stats import DecodeStats
from specdec_kernels.optional import TRANSFORMERS_INTEGRATION_MIN, require

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

from specdec_kernels.integrations import _hf_generate  # noqa: E402  (imports transformers' generation)

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
        raise ValueError(
            f"{ATTENTION_NAME}: attention layer_idx {layer!r} outside the cache's {cache.shape[0]} layers "
            "(early exit needs a model whose forward runs only config.num_hidden_layers layers)"
        )
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
    out = tree_attention(  # q as transformers holds it, (B, H, N, D): no copy
        query,
        k_cache,
        v_cache,
        step.cache_seqlens,
        step.tree_mask,
        sm_scale=kwargs.get("scaling"),
        backend=step.backend,
        validate=False,
        q_layout="HND",
    )
    step.layers_seen.add(layer)
    return out.transpose(1, 2), None  # (B, N, H, D), the contiguous output itself


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


_SWAP_LOCK = threading.Lock()
# model -> [HFCausalLM instances using it, the attention implementation to restore after the last]
_IN_USE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _early_exit_model(model, num_layers: int):
    """``model`` running only its first ``num_layers`` decoder layers, then its final norm and head
    (generate's ``assistant_early_exit``): a shallow copy sharing every weight whose base model
    has a config copy with ``num_hidden_layers = num_layers`` (transformers' decoders run
    ``layers[: config.num_hidden_layers]``).  The shared model is never modified, so other
    threads can run it meanwhile."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, torch.nn.Module) or not hasattr(base, "config"):
        raise ValueError(f"assistant_early_exit: {type(model).__name__} has no base model to exit early from")
    config = copy.copy(base.config)
    config.num_hidden_layers = num_layers
    short_base = copy.copy(base)
    short_base.config = config
    short = copy.copy(model)
    short._modules = dict(model._modules)
    short._modules[prefix] = short_base
    return short


class HFCausalLM:
    """A transformers causal LM with the call interface of ``specdec_kernels.decoding.Transformer``
    (what ``SpeculativeDecoder`` and ``ModelDrafter`` use), attending through ``"specdec_tree"``.

    Construction switches the model's attention implementation to ``"specdec_tree"`` (which
    behaves as ``"sdpa"`` outside our forwards); ``restore()`` (or leaving the ``with`` block)
    puts the previous one back.  The switch is counted per model: several ``HFCausalLM`` of one
    model (``speculative_generate`` running in several threads) share it, and the last one
    restored restores it, so one finishing never pulls the implementation from under another.

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
        self._exits: dict = {}  # num_layers -> the model running its first num_layers layers
        self._restored = True
        with _SWAP_LOCK:
            entry = _IN_USE.get(model)
            if entry is None:
                previous = model.config._attn_implementation
                if previous != ATTENTION_NAME:
                    model.set_attn_implementation(ATTENTION_NAME)
                entry = _IN_USE[model] = [0, previous]
            entry[0] += 1
        self._restored = False

    def restore(self) -> None:
        """Release the model (idempotent): the last ``HFCausalLM`` of a model to be restored puts its
        previous attention implementation back; others, in other threads, keep running on it."""
        with _SWAP_LOCK:
            if self._restored:
                return
            self._restored = True
            entry = _IN_USE.get(self.hf)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del _IN_USE[self.hf]
                if entry[1] != ATTENTION_NAME:
                    self.hf.set_attn_implementation(entry[1])

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
        hidden_layers: Sequence[int] = (),
        host_seqlens: Optional[Sequence[int]] = None,
    ) -> Optional[torch.Tensor]:
        """Feed a block of N new tokens per sequence; return their next-token logits (the
        contract of ``Transformer.forward``; hidden states, ``return_hidden`` and
        ``hidden_layers``, are not available).

        Args:
            tokens: (B, N) int64: the block (for verification: root then drafts).
            positions: (B, N) int64 rotary positions (``cache_seqlens + depth``), passed as
                transformers' ``position_ids``.
            kv_cache: (L, 2, B, Hkv, S, D) from ``new_kv_cache``; the block's K/V are written at
                slots ``cache_seqlens[b] + i``.
            cache_seqlens: (B,) int32, tokens already cached per sequence; + N <= S.
            tree_mask: bool (N, N) / (B, N, N) ancestor mask of the block, None = chain.
            num_layers: None or all the layers; fewer: only the first num_layers layers, then the
                final norm and head (early exit; the cache then holds num_layers layers).
            logit_rows: (B, R) int64: logits of these block rows only (R = 0: none).
            compute_logits: False: run for the cache writes only, return None.
            host_seqlens: cache_seqlens' values as the caller keeps them on the host (the
                engine loop does), or None: read from cache_seqlens (a device read on a GPU).

        Returns:
            (B, N or R, vocab) float32 logits, or None (R = 0, compute_logits False).

        Raises:
            ValueError: num_layers outside 1..layers, return_hidden or hidden_layers, a cache
                that does not fit, a layer whose attention did not go through the interface,
                early exit on a model whose forward does not stop at
                ``config.num_hidden_layers``.
        """
        layers = self.args.num_layers if num_layers is None else num_layers
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= self.args.num_layers:
            raise ValueError(f"num_layers must lie in 1..{self.args.num_layers}, got {num_layers!r}")
        hf = self.hf
        if layers < self.args.num_layers:
            hf = self._exits.get(layers)
            if hf is None:
                hf = self._exits[layers] = _early_exit_model(self.hf, layers)
        if return_hidden or len(hidden_layers):
            raise ValueError(
                "return_hidden is not available for transformers models (drafters that want hidden states)"
            )
        B, N = tokens.shape
        starts = [int(v) for v in host_seqlens] if host_seqlens is not None else cache_seqlens.tolist()
        if kv_cache.dim() != 6 or kv_cache.shape[0] < layers or kv_cache.shape[2] != B:
            raise ValueError(f"kv_cache must have shape (L={layers}, 2, B={B}, Hkv, S, D), got {tuple(kv_cache.shape)}")
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
            out = hf(input_ids=tokens, position_ids=positions, use_cache=False, logits_to_keep=keep, return_dict=True)
        finally:
            _CURRENT.reset(token)
        if step.layers_seen != set(range(layers)):
            missing = sorted(set(range(layers)) - step.layers_seen)
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


def _check_input_ids(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.LongTensor of shape (batch, length), got {type(input_ids).__name__}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        hint = " (one prompt: input_ids[None]; generate fails on 1-D input_ids too)" if input_ids.dim() == 1 else ""
        raise ValueError(f"input_ids must have shape (batch >= 1, length >= 1), got {tuple(input_ids.shape)}{hint}")


def _prompts(input_ids: torch.Tensor, attention_mask, vocab: int) -> Tuple[List[List[int]], List[int]]:
    """Left-padded ids and their 0/1 mask -> (the real tokens of each row, each row's padding)."""
    ids = input_ids.cpu().to(torch.int64)
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
    return prompts, (~mask).sum(dim=1).tolist()


# generate's arguments this loop cannot reproduce exactly: (GenerationConfig field, is it set?, why)
_REFUSED_FIELDS = (
    ("num_beams", lambda v: v is not None and v > 1, "beam search keeps several hypotheses per row"),
    ("num_beam_groups", lambda v: v is not None and v > 1, "group beam search"),
    ("diversity_penalty", lambda v: bool(v), "group beam search"),
    ("penalty_alpha", lambda v: v is not None and v > 0, "contrastive search"),
    ("dola_layers", lambda v: v is not None, "DoLa decoding"),
    ("constraints", lambda v: v is not None, "constrained beam search"),
    ("force_words_ids", lambda v: v is not None, "constrained beam search"),
    ("use_mtp", lambda v: bool(v), "multi-token prediction heads are not implemented here"),
    ("speculation_type", lambda v: v is not None, "only our own drafters are implemented here"),
    ("assistant_ensemble_weight", lambda v: v is not None, "ensemble verification is lossy"),
    ("guidance_scale", lambda v: v is not None and v != 1, "classifier-free guidance runs a second batch"),
    ("watermarking_config", lambda v: v is not None, "watermarking processors assume one call per token"),
    ("output_attentions", lambda v: bool(v), "attentions are not computed by our kernel"),
    ("output_hidden_states", lambda v: bool(v), "hidden states are not returned by this loop"),
    ("cache_implementation", lambda v: v == "quantized", "a quantized cache changes the numbers"),
)
# model inputs generate passes on (or a caller may), and what this loop does with them
_MODEL_KWARGS = ("attention_mask", "position_ids", "logits_to_keep", "use_cache", "cache", "past_key_values")


def _refuse_config(gen_config, prepared: bool) -> None:
    for name, is_set, why in _REFUSED_FIELDS:
        value = getattr(gen_config, name, None)
        if is_set(value):
            raise ValueError(f"speculative_generate does not support {name}={value!r}: {why}")
    if gen_config.token_healing and not prepared:
        raise ValueError("speculative_generate does not support token_healing=True (call model.heal_tokens first)")
    if not isinstance(gen_config.do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {type(gen_config.do_sample).__name__}")
    for name in ("max_new_tokens", "max_length", "min_new_tokens", "min_length"):
        _check_int(name, getattr(gen_config, name, None), 0, allow_none=True)
    top_p = gen_config.top_p
    if gen_config.do_sample and top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise TypeError(f"top_p must be a number or None, got {type(top_p).__name__}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    schedule = gen_config.num_assistant_tokens_schedule
    if schedule not in (None, "constant", "heuristic", "heuristic_transient"):
        raise ValueError(
            f"num_assistant_tokens_schedule must be 'constant', 'heuristic' or 'heuristic_transient', got {schedule!r}"
        )


def _check_model_kwargs(model_kwargs: dict, mask: torch.Tensor) -> None:
    """Inputs beside input_ids: those generate itself hands a custom loop are checked or ignored
    (our KV cache replaces transformers'); anything else is refused by name."""
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _MODEL_KWARGS)
    if unknown:
        raise ValueError(
            f"speculative_generate does not take {unknown} (not GenerationConfig fields, and model inputs "
            "other than attention_mask are not supported; typos of generate's arguments show up here too)"
        )
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if cache is not None and (not hasattr(cache, "get_seq_length") or cache.get_seq_length() != 0):
            raise ValueError(f"{name}: a filled transformers cache cannot be continued here (our KV cache is used)")
    use_cache = model_kwargs.get("use_cache")
    if use_cache is not None and not isinstance(use_cache, bool):
        raise TypeError(f"use_cache must be a bool, got {type(use_cache).__name__}")
    positions = model_kwargs.get("position_ids")
    if positions is not None:
        m = mask.cpu().long()
        expected = (m.cumsum(-1) - 1).masked_fill(m == 0, 0)
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != tuple(m.shape):
            raise ValueError(f"position_ids must have input_ids' shape {tuple(m.shape)}")
        if not torch.equal(positions.cpu().long(), expected):
            raise ValueError(
                "position_ids must be those of the attention mask (cumulative count of tokens - 1, as generate "
                "derives them); other positions are not supported"
            )


def speculative_generate(
    model,
    input_ids: Optional[torch.Tensor] = None,
    generation_config: Optional["transformers.GenerationConfig"] = None,
    logits_processor: Optional["transformers.LogitsProcessorList"] = None,
    stopping_criteria: Optional["transformers.StoppingCriteriaList"] = None,
    prefix_allowed_tokens_fn=None,
    synced_gpus: Optional[bool] = None,
    assistant_model=None,
    streamer=None,
    negative_prompt_ids: Optional[torch.Tensor] = None,
    negative_prompt_attention_mask: Optional[torch.Tensor] = None,
    *,
    drafter: Optional[Drafter] = None,
    tree: Union[None, bool, Sequence[int]] = None,
    num_draft_tokens: Union[None, int, DraftLengthPolicy] = None,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    attention_backend: Optional[str] = None,
    return_stats: bool = False,
    tokenizer=None,
    assistant_tokenizer=None,
    **kwargs,
) -> Union[torch.Tensor, "transformers.generation.utils.GenerateDecoderOnlyOutput", Tuple[object, DecodeStats]]:
    """Speculative decoding of a transformers causal LM with our tree attention and
    verification ops: ``model.generate``'s arguments, defaults and output, decoded by drafting
    and verifying (any batch size, left padding, chains or token trees).  It is also a
    ``custom_generate`` callable: ``model.generate(**batch, custom_generate=speculative_generate)``.

    Drafts come from at most one source (none: plain decoding through our kernels):
    ``prompt_lookup_num_tokens`` (prompt lookup decoding, Saxena 2023: our ``NgramDrafter``),
    ``assistant_model`` (a smaller transformers model with the same vocabulary, run through
    ``"specdec_tree"`` with its own KV cache: Leviathan et al. 2023), ``assistant_early_exit``
    (the target's first layers, then its norm and head, LayerSkip-style) or ``drafter`` (any
    ``specdec_kernels.decoding.Drafter`` that needs no hidden states).  Each step the target
    scores the root and all drafts in one forward; greedy runs keep the longest path the
    target's argmax agrees with (``verify_greedy`` / ``verify_tree_greedy``), sampling runs use
    lossless rejection sampling (``rejection_sample`` / ``tree_rejection_sample``); the accepted
    nodes' K/V are compacted in place (``compact_kv_cache``).

    Generate's arguments.  The generation config is resolved by transformers as ``generate``
    does (``generation_config`` or the model's, updated by keyword arguments, generate's
    defaults: 20 new tokens, greedy, ``top_k=50`` when sampling, ...), and transformers' own
    logits processors and stopping criteria are built from it.  Honoured exactly:
    ``max_new_tokens`` / ``max_length``, ``min_new_tokens`` / ``min_length``, ``eos_token_id``
    (an int or a list), ``pad_token_id`` (default: the first EOS), ``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``, ``epsilon_cutoff``,
    ``eta_cutoff``, ``top_h``, ``repetition_penalty``, ``no_repeat_ngram_size``,
    ``bad_words_ids``, ``sequence_bias``, ``suppress_tokens``, ``begin_suppress_tokens``,
    ``forced_bos_token_id``, ``forced_eos_token_id``, ``exponential_decay_length_penalty``,
    ``remove_invalid_values``, ``renormalize_logits``, ``logits_processor`` (row-wise ones),
    ``prefix_allowed_tokens_fn``, ``stopping_criteria``, ``stop_strings`` (with
    ``tokenizer``), ``max_time`` (checked after each step's tokens), ``streamer``,
    ``return_dict_in_generate`` with ``output_scores`` / ``output_logits``,
    ``num_return_sequences`` (sampling), ``num_assistant_tokens`` and
    ``num_assistant_tokens_schedule`` ("heuristic": per row, not kept across calls),
    ``max_matching_ngram_size`` (default 5 here, 2 in generate; speed only).  The processors
    are applied, with each node's own context, to the target's logits of every draft node and
    to an assistant model's logits, so the verified distribution is generate's and
    verification stays lossless; temperature / top-k / top-p alone run in our fused
    ``sampling_probs``.  Accepted without effect on the output: ``use_cache``,
    ``cache_implementation`` (but "quantized"), ``compile_config``, ``prefill_chunk_size``,
    ``assistant_confidence_threshold`` (not implemented: a speed knob), ``synced_gpus=False``.
    Refused with a ``ValueError`` naming them: ``num_beams > 1`` and the other beam, contrastive,
    DoLa and constrained modes, ``guidance_scale``, ``negative_prompt_ids``,
    ``watermarking_config``, ``use_mtp``, ``speculation_type``, ``assistant_ensemble_weight``
    (lossy), ``output_attentions``, ``output_hidden_states``, ``token_healing``,
    ``assistant_tokenizer`` (different vocabularies), ``synced_gpus=True``, model inputs other
    than ``attention_mask`` (e.g. ``inputs_embeds``), a filled cache, stopping criteria beside
    EOS / length in a batch without ``eos_token_id`` (generate then keeps decoding stopped
    rows), processors that need the whole batch.

    Args:
        model: the target, a transformers ``*ForCausalLM`` (see ``unsupported_model``).  Its
            attention implementation is switched to ``"specdec_tree"`` during the call and
            restored by the last of concurrent calls on it (threads may share a model).
        input_ids: (B, P) integer token ids, left-padded when the prompts differ in length
            (1-D is refused, as generate fails on it; use ``input_ids[None]``).
        generation_config: a ``transformers.GenerationConfig`` (None: the model's).
        logits_processor: extra transformers logits processors; each must be row-wise.
        stopping_criteria: extra transformers stopping criteria, called per row with that
            row's (1, length) input_ids after every emitted token.
        prefix_allowed_tokens_fn: generate's constraint ``fn(batch_id, input_ids_row)``.
        synced_gpus: None or False.
        assistant_model: a transformers causal LM with the target's vocabulary size.
        streamer: a transformers streamer (``TextStreamer``, ``TextIteratorStreamer``, ...):
            ``put`` the prompt (B, P), then the new tokens as (B, n) blocks of whole columns
            (finished rows padded), then ``end()``.
        negative_prompt_ids, negative_prompt_attention_mask: refused (guidance).
        drafter: a ``Drafter`` instance instead (e.g. ``NgramDrafter(tree=True, max_chains=4)``).
        tree: None / False: chains.  True: token trees (prompt lookup: up to 2 matches merged;
            assistant / early exit: children per node ``DEFAULT_TREE_WIDTHS``).  A sequence of
            ints (assistant / early exit): the static tree's children per node by depth.
        num_draft_tokens: draft depth K per step: an int >= 0 or a ``DraftLengthPolicy``;
            overrides ``num_assistant_tokens``.  None: ``prompt_lookup_num_tokens`` for prompt
            lookup; ``num_assistant_tokens`` when set (generate's default of 20 assumes its
            confidence cut-off, not implemented here, so unset it is
            ``DEFAULT_ASSISTANT_TOKENS``; through ``custom_generate`` a value equal to that
            default counts as unset) for an assistant or early exit; the default for a drafter.
        seed: sampling seed; row b draws from its own generator seeded ``seed + b`` (its tokens
            do not depend on the rest of the batch).
        generator: a ``torch.Generator`` to draw the seed from instead (not with seed).  None
            of both: seeds from torch's global generator.
        attention_backend: ``tree_attention`` backend (None: automatic).
        return_stats: also return the run's ``DecodeStats`` (target passes, acceptance, times).
        tokenizer: for ``stop_strings``.
        assistant_tokenizer: refused.
        **kwargs: ``GenerationConfig`` fields (``max_new_tokens``, ``do_sample``,
            ``prompt_lookup_num_tokens``, ``assistant_early_exit``, ...) and
            ``attention_mask`` ((B, P) 0/1, 0 on the left padding; None: inferred as generate
            does, from pad_token_id unless it is an EOS token).  What ``generate`` hands a
            custom loop (``position_ids`` of the mask, ``logits_to_keep``, ``use_cache``, an
            empty ``cache``) is accepted.

    Returns:
        (B, P + T) int64 on input_ids' device: input_ids followed by the new tokens, T the
        longest row's new tokens; rows that stopped earlier are padded with the pad token (the
        layout of ``generate``'s output).  With ``return_dict_in_generate``: a
        ``GenerateDecoderOnlyOutput`` with ``sequences`` and, when asked for, ``scores`` /
        ``logits`` (one (B, V) float32 tensor per new position, as generate; positions after a
        row stopped hold NaN), no cache.  With ``return_stats``: (that, stats).

    Raises:
        TypeError: model / assistant_model not transformers models, input_ids not an integer
            tensor, drafter not a Drafter, an argument of the wrong type (the message names it).
        ValueError: what transformers' generate refuses (its message), more than one draft
            source, right padding, token ids outside the vocabulary, an assistant with another
            vocabulary size, seed with generator, a tree form that does not fit the draft
            source, prompts plus new tokens longer than the model's positions or its sliding
            window, a model ``unsupported_model`` refuses, the refused arguments above.

    Example::

        out = speculative_generate(model, **batch, prompt_lookup_num_tokens=8, max_new_tokens=64)
        out = model.generate(**batch, custom_generate=speculative_generate, prompt_lookup_num_tokens=8)
        texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    """
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    # ---- our own arguments, all checked before any model work
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model must be a transformers causal LM (PreTrainedModel), got {type(model).__name__}")
    if input_ids is None:
        input_ids = kwargs.pop("inputs", None)
    if input_ids is None:
        raise ValueError("input_ids is required (generate's start from bos_token_id alone is not supported)")
    _check_input_ids(input_ids)
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
    if seed is not None and generator is not None:
        raise ValueError("give seed or generator, not both")
    _check_int("seed", seed, 0, allow_none=True)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats must be a bool, got {type(return_stats).__name__}")
    if num_draft_tokens is not None and not isinstance(num_draft_tokens, DraftLengthPolicy):
        _check_int("num_draft_tokens", num_draft_tokens, 0)
    if synced_gpus:
        raise ValueError("speculative_generate does not support synced_gpus=True (one process decodes)")
    for name, value in (
        ("negative_prompt_ids", negative_prompt_ids),
        ("negative_prompt_attention_mask", negative_prompt_attention_mask),
    ):
        if value is not None:
            raise ValueError(f"speculative_generate does not support {name} (classifier-free guidance)")
    if assistant_tokenizer is not None:
        raise ValueError(
            "speculative_generate does not support assistant_tokenizer: the assistant must share the "
            "target's vocabulary (universal assisted decoding is not implemented)"
        )

    # ---- generate's configuration: transformers resolves it, as generate does
    # generate itself calls a custom_generate loop with a prepared config (special-token tensors
    # set), its own logits processors and stopping criteria, and inputs already expanded
    prepared = generation_config is not None and hasattr(generation_config, "_eos_token_tensor")
    device = model.device
    if prepared:
        gen_config, model_kwargs = generation_config, dict(kwargs)
        # generate has filled in its defaults: its default depth counts as unset
        default_k = transformers.GenerationConfig._get_default_generation_params()["num_assistant_tokens"]
        explicit_k = (
            gen_config.num_assistant_tokens != default_k or model.generation_config.num_assistant_tokens is not None
        )
        has_default_max_length = has_default_min_length = False
    else:
        if generation_config is not None and not isinstance(generation_config, transformers.GenerationConfig):
            raise TypeError(
                f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}"
            )
        own = model.generation_config
        has_default_max_length = (
            kwargs.get("max_length") is None
            and (generation_config is None or generation_config.max_length is None)
            and own.max_length is None
        )
        has_default_min_length = (
            kwargs.get("min_length") is None
            and (generation_config is None or generation_config.min_length is None)
            and own.min_length is None
        )
        explicit_k = (
            kwargs.get("num_assistant_tokens") is not None
            or (generation_config is not None and generation_config.num_assistant_tokens is not None)
            or own.num_assistant_tokens is not None
        )
        # sampling values exactly as given, named, before transformers' own checks (which take
        # a string temperature for a bad value) and before any cast
        for name, check in (
            ("temperature", lambda n, v: sampling_temperature(n, v, finite=True)),
            ("top_k", sampling_top_k),
            ("top_p", sampling_top_p),
        ):
            if kwargs.get(name) is not None:
                check(name, kwargs[name])
        gen_config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    _refuse_config(gen_config, prepared)
    stops = _token_list("eos_token_id", gen_config.eos_token_id)
    vocab = _text_config(model).vocab_size
    if stops and (min(stops) < 0 or max(stops) >= vocab):
        raise ValueError(f"eos_token_id must lie in [0, {vocab}), got {stops}")
    _check_int("pad_token_id", gen_config.pad_token_id, 0, allow_none=True)
    attention_mask = model_kwargs.pop("attention_mask", None)

    # the draft source
    lookup = gen_config.prompt_lookup_num_tokens
    early_exit = gen_config.assistant_early_exit
    sources = [
        n
        for n, v in (
            ("assistant_model", assistant_model),
            ("prompt_lookup_num_tokens", lookup),
            ("assistant_early_exit", early_exit),
            ("drafter", drafter),
        )
        if v is not None
    ]
    if len(sources) > 1:
        raise ValueError(f"give at most one draft source, got {' and '.join(sources)}")
    _check_int("prompt_lookup_num_tokens", lookup, 1, allow_none=True)
    _check_int("max_matching_ngram_size", gen_config.max_matching_ngram_size, 1, allow_none=True)
    _check_int("num_assistant_tokens", gen_config.num_assistant_tokens, 0, allow_none=True)
    layers = _text_config(model).num_hidden_layers
    if early_exit is not None:
        _check_int("assistant_early_exit", early_exit, 1)
        if early_exit >= layers:
            raise ValueError(f"assistant_early_exit must be below the model's {layers} layers, got {early_exit}")
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
        if assistant_model is None and early_exit is None:
            raise ValueError(
                "tree as widths per depth needs assistant_model or assistant_early_exit (prompt lookup takes tree=True)"
            )
    if tree and drafter is not None:
        raise ValueError("tree: configure the drafter's own tree instead (e.g. NgramDrafter(tree=True))")
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

    # ---- inputs, lengths, processors and criteria: transformers' own, as generate builds them
    ids = input_ids.to(device)
    mask = attention_mask.to(device) if isinstance(attention_mask, torch.Tensor) else attention_mask
    if not prepared:
        n_ret = gen_config.num_return_sequences or 1
        if n_ret > 1:  # generate's expansion: each prompt n times in a row
            ids = ids.repeat_interleave(n_ret, dim=0)
            mask = mask.repeat_interleave(n_ret, dim=0) if isinstance(mask, torch.Tensor) else mask
        if gen_config.eos_token_id is not None and len(_token_list("eos_token_id", gen_config.eos_token_id)) == 0:
            # eos_token_id=[]: no stop token (transformers' preparation indexes the first EOS)
            gen_config.eos_token_id = None
        model._prepare_special_tokens(gen_config, mask is not None, device=device, batch_size=ids.shape[0])
        if mask is None:
            mask = model._prepare_attention_mask_for_generation(ids, gen_config, {})
    elif mask is None:  # generate drops an all-ones mask before calling a custom loop
        mask = torch.ones_like(ids)
    B, P = ids.shape
    prompts, pad_lengths = _prompts(ids, mask, vocab)
    _check_model_kwargs(model_kwargs, mask)
    if prepared:
        processors = logits_processor if logits_processor is not None else transformers.LogitsProcessorList()
        criteria = stopping_criteria if stopping_criteria is not None else transformers.StoppingCriteriaList()
    else:
        gen_config = model._prepare_generated_length(
            generation_config=gen_config,
            has_default_max_length=has_default_max_length,
            has_default_min_length=has_default_min_length,
            model_input_name="input_ids",
            input_ids_length=P,
            inputs_tensor=ids,
        )
        model._validate_generated_length(gen_config, P, has_default_max_length)
        processors = model._get_logits_processor(
            generation_config=gen_config,
            input_ids_seq_length=P,
            encoder_input_ids=ids,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
            logits_processor=logits_processor if logits_processor is not None else transformers.LogitsProcessorList(),
            device=device,
            model_kwargs={"attention_mask": mask},
        )
        criteria = model._get_stopping_criteria(
            generation_config=gen_config,
            stopping_criteria=stopping_criteria
            if stopping_criteria is not None
            else transformers.StoppingCriteriaList(),
            tokenizer=tokenizer,
        )
    rows = _hf_generate.row_processors(processors, B)
    fused = _hf_generate.kernel_sampling(processors, gen_config.do_sample)
    max_new_tokens = gen_config.max_length - P
    others = transformers.StoppingCriteriaList()
    has_eos = False
    for c in criteria:
        if isinstance(c, MaxLengthCriteria):
            max_new_tokens = min(max_new_tokens, c.max_length - P)
        elif isinstance(c, EosTokenCriteria):
            has_eos = True
            stops = sorted(set(stops) | set(_token_list("eos_token_id", c.eos_token_id)))
        else:
            has_eos = has_eos or hasattr(c, "eos_token_id")
            others.append(c)
    if others and not has_eos and B > 1:
        raise ValueError(
            f"stopping criteria {[type(c).__name__ for c in others]} in a batch without eos_token_id: generate "
            "then keeps decoding the rows they stop until every row stops, which this loop does not do; "
            "set eos_token_id (or decode one row at a time)"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_length ({gen_config.max_length}) leaves no new token after the {P} input tokens")
    pad = gen_config._pad_token_tensor
    pad_token_id = int(pad.flatten()[0]) if isinstance(pad, torch.Tensor) else (stops[0] if stops else 0)
    longest = max(len(p) for p in prompts) + max_new_tokens + 1
    for who, m in (("model", model), ("assistant_model", assistant_model)):
        window = getattr(_text_config(m), "sliding_window", None) if m is not None else None
        if isinstance(window, int) and longest > window:
            raise ValueError(
                f"{who} has a sliding window of {window} tokens, shorter than the prompt plus max_new_tokens "
                f"({longest}): sliding-window attention is not implemented"
            )
    want_scores = bool(gen_config.return_dict_in_generate and gen_config.output_scores)
    want_logits = bool(gen_config.return_dict_in_generate and gen_config.output_logits)
    if gen_config.do_sample:
        sampling = fused if fused is not None else SamplingParams(1.0)  # the processors did the rest
    else:
        sampling = SamplingParams()
    if generator is not None:
        seed = int(torch.randint(0, 2**62, (), generator=generator))
    prefixes = [ids[b, : pad_lengths[b]].tolist() for b in range(B)]
    if num_draft_tokens is not None:
        k = num_draft_tokens
    elif lookup is not None:
        k = lookup
    elif assistant_model is not None or early_exit is not None:
        start = gen_config.num_assistant_tokens if explicit_k and gen_config.num_assistant_tokens is not None else None
        start = DEFAULT_ASSISTANT_TOKENS if start is None else start
        heuristic = gen_config.num_assistant_tokens_schedule in ("heuristic", "heuristic_transient")
        k = _hf_generate.heuristic_schedule(start) if heuristic else start
    elif drafter is not None:
        k = DEFAULT_ASSISTANT_TOKENS
    else:
        k = 0

    # ---- the run
    if streamer is not None and not prepared:  # generate puts the prompt before calling a custom loop
        streamer.put(ids.cpu())
    process = None if fused is not None else rows  # logits processors inside the forwards
    target_core = HFCausalLM(model, attention_backend=attention_backend)
    assistant_core = None
    try:
        record = want_scores or want_logits
        target = target_core
        if process is not None or record:
            target = _hf_generate.ProcessedModel(target_core, process, prefixes, record=record)
        wrapped = [target] if target is not target_core else []

        def drafting(core):
            if process is None:
                return core
            w = _hf_generate.ProcessedModel(core, process, prefixes)
            wrapped.append(w)
            return w

        widths = None if not tree else (DEFAULT_TREE_WIDTHS if tree is True else tree)
        if lookup is not None:
            the_drafter: Drafter = NgramDrafter(gen_config.max_matching_ngram_size or 5, tree=bool(tree))
        elif assistant_model is not None:
            assistant_core = (
                target_core
                if assistant_model is model
                else HFCausalLM(assistant_model, attention_backend=attention_backend)
            )
            the_drafter = ModelDrafter(drafting(assistant_core), tree_widths=widths)
        elif early_exit is not None:
            the_drafter = ModelDrafter(drafting(target_core), num_layers=early_exit, tree_widths=widths)
        elif drafter is not None:
            the_drafter = drafter
        else:
            the_drafter = NoDrafter()
        hook = _hf_generate.StopAndScore(
            others,
            prefixes,
            target if record else None,
            rows if fused is not None else None,
            want_scores,
            want_logits,
        )
        feed = _hf_generate.StreamFeed(streamer, B, pad_token_id) if streamer is not None else None

        def on_step(state) -> None:
            for w in wrapped:
                w.state = state
            if feed is not None:
                feed(state)

        decoder = SpeculativeDecoder(
            target, the_drafter, stop_token_ids=stops, stop_check=hook if hook.needed else None
        )
        result = decoder.generate(
            prompts, max_new_tokens, num_draft_tokens=k, sampling=sampling, seeds=seed, on_step=on_step
        )
    finally:
        if assistant_core is not None and assistant_core is not target_core:
            assistant_core.restore()
        target_core.restore()
    if streamer is not None:
        streamer.end()

    T = max(len(t) for t in result.tokens)
    out = torch.full((B, P + T), pad_token_id, dtype=torch.int64)
    out[:, :P] = ids.cpu()
    for b, t in enumerate(result.tokens):
        out[b, P : P + len(t)] = torch.tensor(t, dtype=torch.int64)
    out = out.to(input_ids.device)
    if gen_config.return_dict_in_generate:
        extra = hook.tuples(T, vocab, input_ids.device)
        out = GenerateDecoderOnlyOutput(sequences=out, scores=extra["scores"], logits=extra["logits"])
    return (out, result.stats) if return_stats else out
