"""A Llama-family forward pass written for speculative decoding.

Every forward feeds a block of N new tokens per sequence whose keys and values are
written into a static KV cache (layout ``[L, 2, B, Hkv, S, D]``, the layout of
``compact_kv_cache``, or a paged pool with block tables, ``paged.PagedKVCache``) and attends
through the registered ``tree_attention`` ops (``attend``):

* prefill: the prompt as a chain (``tree_mask=None``);
* plain decoding: N = 1;
* verification: the root plus the draft tokens, with the token tree's ancestor mask (or
  ``None`` for a chain).

Position convention (used by the engine and the drafters): ``cache_seqlens[b]`` counts the
tokens of sequence b whose K/V are in the cache; the last committed token (the *root*) is
*not* yet in the cache.  A block is ``[root, draft nodes...]``, written at slots
``cache_seqlens[b] + i``; node i has the rotary position ``cache_seqlens[b] + depth_i``
(root depth 0), so siblings share a position.  After verification the root and the
accepted drafts are compacted to ``cache_seqlens[b] .. cache_seqlens[b] + m`` and
``cache_seqlens[b] += m + 1``; the emitted bonus token becomes the next root.

Weights come from a transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v biases) or
``MistralForCausalLM`` (its config and state dict), see ``Transformer.from_hf``; settings this
forward does not implement are refused (``unsupported_hf_config``).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from specdec_kernels import SUPPORTED_HEAD_DIMS
from specdec_kernels.decoding import packed
from specdec_kernels.decoding.paged import PagedKVCache


@dataclass
class ModelArgs:
    """Shape of a Llama-family decoder (names follow transformers' LlamaConfig)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projections with biases (Qwen2)

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        """From a transformers ``LlamaConfig``, ``Qwen2Config`` or ``MistralConfig`` (or
        anything with the same attributes, ``model_type`` included).

        Raises:
            ValueError: a config this engine cannot run exactly (``unsupported_hf_config``
                lists why: another model type, attention or MLP biases other than Qwen2's
                q/k/v biases, a sliding window shorter than the positions, a RoPE type
                other than default / linear / llama3 / yarn, an activation other than SiLU,
                logit soft-capping, bidirectional attention).
        """
        problems = unsupported_hf_config(config)
        if problems:
            raise ValueError(
                f"Transformer.from_hf cannot run this {getattr(config, 'model_type', None)!r} config exactly: "
                + "; ".join(problems)
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            max_position=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=config.model_type == "qwen2",
        )


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # frequencies independent of the sequence length


def _rope_parameters(config) -> dict:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(rope)


def unsupported_hf_config(config) -> List[str]:
    """Why ``Transformer`` cannot run a transformers config exactly: [] when it can.

    Supported: ``model_type`` llama (no attention or MLP bias), qwen2 (q/k/v biases, no
    o_proj bias) and mistral; SiLU gated MLPs, RMSNorm, GQA, RoPE of a static type
    (default, linear, llama3, yarn: the frequencies do not depend on the sequence length),
    full causal attention (a sliding window only when it is at least
    ``max_position_embeddings``, so that it never binds).

    Returns:
        One human-readable line per unsupported setting, naming the config attribute.
    """
    problems: List[str] = []
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act {act!r} (only 'silu', the SwiGLU MLP, is implemented)")
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias=True (biases on q/k/v/o projections; only Qwen2's q/k/v biases are supported)")
    if getattr(config, "mlp_bias", False):
        problems.append("mlp_bias=True (biases on the MLP projections are not implemented)")
    max_pos = getattr(config, "max_position_embeddings", None)
    window = getattr(config, "sliding_window", None)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if model_type == "qwen2":
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        if getattr(config, "use_sliding_window", False) and not layer_types:
            sliding = [-1]
    else:
        sliding = [-1] if window is not None else []
    if sliding and window is not None and max_pos is not None and window >= max_pos:
        sliding = []  # the window covers every position: plain causal attention
    if sliding:
        problems.append(
            f"sliding_window={window} < max_position_embeddings={max_pos} (sliding-window attention is not implemented)"
        )
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        problems.append(f"layer_types {other} (only full attention layers are implemented)")
    rope = _rope_parameters(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        problems.append(
            f"rope_type {rope_type!r} (supported: {', '.join(STATIC_ROPE_TYPES)}; "
            "dynamic and longrope change the frequencies with the sequence length)"
        )
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            problems.append(f"{name}={getattr(config, name)} (soft-capping is not implemented)")
    if not getattr(config, "is_causal", True):
        problems.append("is_causal=False (bidirectional attention)")
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        problems.append(f"head_dim {head_dim} (tree_attention supports {SUPPORTED_HEAD_DIMS})")
    return problems


SKINNY_ROWS = 16  # on CPU, up to this many rows may take the weight @ x.T path of ``linear``
SKINNY_CHUNK = 8
LINEAR_ENV = "SPECDEC_LINEAR"  # "auto" (default: measure), "f_linear", "skinny" or "packed" (forced)
LINEAR_PATHS = ("f_linear", "skinny", "packed")
PACK_ENV = "SPECDEC_PACK_WEIGHTS"  # "0": from_hf registers no packed weights

# shape class -> "f_linear", "skinny" or "packed", chosen by measurement once per process
_LINEAR_CHOICE: Dict[tuple, str] = {}
_LINEAR_TIMES: Dict[tuple, Dict[str, float]] = {}


def _skinny(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = flat.shape[0]
    if rows == 1:
        return (weight @ torch.cat([flat, flat]).T)[:, :1].T
    return torch.cat([(weight @ flat[i : i + SKINNY_CHUNK].T).T for i in range(0, rows, SKINNY_CHUNK)])


def _row_class(rows: int) -> int:
    """Rows rounded up to a power of two (1, 2, 4, 8, 16): the shape classes of ``linear_choice``."""
    return 1 << max(0, rows - 1).bit_length()


_LINEAR_TRIALS: Dict[tuple, Dict[str, List[float]]] = {}
LINEAR_TRIALS = 3  # timed calls of each path per shape class before the choice


_LOOK_UP = object()  # "find the weight's packed form" (callers that have it pass it down)


def _packed(weight: torch.Tensor, packed_weight) -> Optional["packed.PackedWeight"]:
    return packed.packed_form(weight) if packed_weight is _LOOK_UP else packed_weight


def _linear_key(rows: int, weight: torch.Tensor, packed_weight=_LOOK_UP) -> tuple:
    has_packed = _packed(weight, packed_weight) is not None
    return (tuple(weight.shape), weight.dtype, _row_class(rows), torch.get_num_threads(), has_packed)


def _paths(weight: torch.Tensor, packed_weight=_LOOK_UP) -> Tuple[str, ...]:
    return LINEAR_PATHS if _packed(weight, packed_weight) is not None else LINEAR_PATHS[:2]


def linear_choice(rows: int, weight: torch.Tensor, packed_weight=_LOOK_UP) -> Optional[str]:
    """Which CPU path ``linear`` takes for ``rows`` rows times ``weight``: "f_linear",
    "skinny", "packed", or None while it is still being measured.

    Forced by $SPECDEC_LINEAR ("f_linear", "skinny" or "packed"; "packed" where the weight has no
    packed form is "f_linear"); otherwise measured on the real calls, like an autotuner: the
    first calls of a shape class (weight shape and dtype, rows 1 / 2 / 3-4 / 5-8 / 9-16, thread count,
    whether the weight has a packed form) take the paths in turn, ``LINEAR_TRIALS`` timed calls
    each, in place, with the caches as a decode step leaves them (a weight streamed from memory,
    not a warm copy: timing repeated calls on one weight favours whichever path fits the cache);
    then the fastest by best time is kept for the process, a path other than ``F.linear`` only
    when at least 10% faster than it.  ``F.linear`` is the default.  A machine-specific speed
    choice is never hard-coded: on the development machine the skinny path was about 2x faster at
    2 threads, on an AVX-512 Xeon 3x slower.  The packed path (``decoding.packed``: the same
    weight read from its exact block-quantised form) exists only for weights registered with
    ``packed.register`` (``Transformer.pack_weights``); ``packed_weight`` is that form when the
    caller has looked it up already (None: none)."""
    forced = os.environ.get(LINEAR_ENV, "auto")
    if forced in LINEAR_PATHS:
        return forced if forced in _paths(weight, packed_weight) else "f_linear"
    if forced not in ("", "auto"):
        raise ValueError(f"${LINEAR_ENV} must be 'auto' or one of {LINEAR_PATHS}, got {forced!r}")
    return _LINEAR_CHOICE.get(_linear_key(rows, weight, packed_weight))


def _run_linear(path: str, flat: torch.Tensor, weight: torch.Tensor, packed_weight=_LOOK_UP) -> torch.Tensor:
    if path == "skinny":
        return _skinny(flat, weight)
    if path == "packed":
        return packed.packed_linear(flat, _packed(weight, packed_weight))
    return F.linear(flat, weight)


def _timed_linear(flat: torch.Tensor, weight: torch.Tensor, packed_weight=_LOOK_UP) -> torch.Tensor:
    """One measured call of a shape class still being tuned (see ``linear_choice``)."""
    packed_weight = _packed(weight, packed_weight)
    key = _linear_key(flat.shape[0], weight, packed_weight)
    times = _LINEAR_TRIALS.setdefault(key, {p: [] for p in _paths(weight, packed_weight)})
    path = min(times, key=lambda p: len(times[p]))  # in turn: the least timed next
    t = time.perf_counter()
    out = _run_linear(path, flat, weight, packed_weight)
    times[path].append(time.perf_counter() - t)
    if all(len(v) >= LINEAR_TRIALS for v in times.values()):
        best = {p: min(v) for p, v in times.items()}
        fast = [p for p in best if p == "f_linear" or best[p] < 0.9 * best["f_linear"]]
        _LINEAR_CHOICE[key] = min(fast, key=lambda p: best[p])
        _LINEAR_TIMES[key] = best
        del _LINEAR_TRIALS[key]
    return out


def linear_choices() -> List[Dict]:
    """The choices ``linear`` made in this process (for reports such as bench.e2e's): per shape
    class the path taken and the best measured time of each path in milliseconds."""
    return [
        {
            "weight": list(k[0]),
            "dtype": str(k[1]).replace("torch.", ""),
            "rows": {1: "1", 2: "2", 4: "3-4", 8: "5-8", 16: "9-16"}[k[2]],
            "threads": k[3],
            "choice": c,
            **{
                f"{p}_ms": (_LINEAR_TIMES[k][p] * 1e3 if k in _LINEAR_TIMES and p in _LINEAR_TIMES[k] else None)
                for p in LINEAR_PATHS
            },
        }
        for k, c in _LINEAR_CHOICE.items()
    ]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no bias).

    On CPU a decode or verify step multiplies a few rows by a large weight, which is bound by
    streaming the weight from memory.  Some BLAS builds stream it several times faster as
    ``weight @ x.T`` (a skinny right operand, in chunks of at most 8 rows; a single row doubled)
    than as ``x @ weight.T``; others are several times slower that way; and a weight with an
    exact block-quantised form (``decoding.packed``) can be read in a fifth of the bytes.  So
    for up to 16 rows on CPU the path is measured at run time on the real calls
    (``linear_choice``); elsewhere (CUDA, more rows) it is ``F.linear``.
    """
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or rows > SKINNY_ROWS or rows == 0:
        return F.linear(x, weight)
    packed_weight = packed.packed_form(weight)  # looked up once per call (identity + stamp check)
    choice = linear_choice(rows, weight, packed_weight)
    if choice == "f_linear":
        return F.linear(x, weight)
    flat = x.reshape(rows, x.shape[-1])
    if choice is None:
        out = _timed_linear(flat, weight, packed_weight)
    else:
        out = _run_linear(choice, flat, weight, packed_weight)
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one op (transformers' arithmetic in float32: x * rsqrt(mean(x^2) + eps) * weight)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021) in the half-split layout of transformers' Llama.

    x: (B, N, heads, D); cos, sin: (B, N, 1, D).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    backend: Optional[str] = None,
    block_table: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The engine's ``tree_attention`` (one call per layer and forward): the public op's results.

    The call goes straight to the registered op, ``torch.ops.specdec.tree_attention`` (dense
    cache) or ``torch.ops.specdec.paged_tree_attention`` (NHD pools with ``block_table``): it
    runs the op's shape checks and its backend choice, and skips the Python front, whose
    argument normalisation and value checks the engine does not need (every tensor here is
    built by the engine: int32 lengths, bool masks, scale ``D ** -0.5``).

    Args: q [B, N, H, D]; k_cache, v_cache [B, Hkv, S, D], or NHD pools with ``block_table``;
    cache_seqlens int32 [B]; tree_mask bool [N, N] / [B, N, N] or None (a chain);
    backend: None (automatic) or a backend name of ``tree_attention``.
    """
    scale = q.shape[-1] ** -0.5
    if block_table is None:
        return torch.ops.specdec.tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, scale, 0, backend or "")
    return torch.ops.specdec.paged_tree_attention(
        q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, "NHD", scale, 0, backend or ""
    )


class Block(nn.Module):
    """One decoder layer: pre-norm attention (GQA, fused QKV) and a SwiGLU MLP (fused gate/up)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H, Hkv, D = args.num_heads, args.num_kv_heads, args.head_dim
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.wqkv = nn.Linear(args.hidden_size, (H + 2 * Hkv) * D, bias=args.qkv_bias)  # bias: Qwen2
        self.wo = nn.Linear(H * D, args.hidden_size, bias=False)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.w13 = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x, cos, sin, layer_cache, write, cache_seqlens, tree_mask, backend, block_table=None):
        B, N, _ = x.shape
        H, Hkv, D = self.args.num_heads, self.args.num_kv_heads, self.args.head_dim
        qkv = linear(self.attention_norm(x), self.wqkv.weight)
        if self.wqkv.bias is not None:  # Qwen2's q/k/v biases (others: no bias, no extra op)
            qkv = qkv + self.wqkv.bias
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = rotate(q.view(B, N, H, D), cos, sin)
        k = rotate(k.view(B, N, Hkv, D), cos, sin)
        v = v.view(B, N, Hkv, D)
        k_cache, v_cache = layer_cache[0], layer_cache[1]  # [B, Hkv, S, D] views, or [blocks, block_size, Hkv, D] pools
        write(k_cache, k)
        write(v_cache, v)
        attn = attend(q, k_cache, v_cache, cache_seqlens, tree_mask, backend, block_table)
        x = x + linear(attn.reshape(B, N, H * D), self.wo.weight)
        gate, up = linear(self.ffn_norm(x), self.w13.weight).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.w2.weight)


class Transformer(nn.Module):
    """Llama-family causal LM over a static KV cache (see the module docstring).

    Build it with ``Transformer.from_hf(config, state_dict)`` or ``Transformer.from_hf_model``.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0
        self.attention_backend: Optional[str] = None  # tree_attention's backend=; None: automatic

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf(cls, config, state_dict, *, dtype: torch.dtype = torch.float32, pack: bool = True) -> "Transformer":
        """From a transformers config and the state dict of its ``*ForCausalLM``: Llama,
        Qwen2 (q/k/v biases) or Mistral without a binding sliding window.

        Plain RoPE is computed here; scaled variants (``rope_type`` linear, llama3, yarn) take
        their frequencies from transformers' ``LlamaRotaryEmbedding``; q/k/v (and Qwen2's q/k/v
        biases) and gate/up weights are concatenated.  Weights may share memory with
        ``state_dict`` (never modified).  Only a model this engine runs exactly is built:
        every setting it does not implement raises, never a silently different model.

        With ``pack`` (default) a float32 model on CPU also registers the exact block-quantised
        form of each matrix-product weight that has one (``pack_weights``: a GGUF's Q4_1 / Q8_0
        weights de-quantised by transformers, as SmolLM2's; about 0.5 s for it), which ``linear``
        then measures against ``F.linear``; $SPECDEC_PACK_WEIGHTS=0 turns this off.  Moving the
        model to another device leaves the packed forms behind (they are CPU-only).

        Raises:
            ValueError: the config is not supported (``unsupported_hf_config`` names the
                settings); the state dict holds weights this model has no place for (biases
                of a Llama or Mistral, an o_proj or MLP bias, more layers than the config, a
                classification head, ...); or tie_word_embeddings is set and lm_head.weight
                differs from the embeddings.
            KeyError: a weight missing from ``state_dict`` (lm_head.weight of an untied
                model, the q/k/v biases of a Qwen2, ...).
        """
        args = ModelArgs.from_hf_config(config)
        with torch.device("meta"):
            model = cls(args)
        used = set()

        def take(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise KeyError(
                    f"state dict has no {name!r} (needed by a {config.model_type} model of {args.num_layers} layers)"
                )
            used.add(name)
            return state_dict[name]

        sd = {}
        embed = take("model.embed_tokens.weight")
        sd["tok_embeddings.weight"] = embed
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            sd[f"layers.{i}.attention_norm.weight"] = take(p + "input_layernorm.weight")
            sd[f"layers.{i}.wqkv.weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            if args.qkv_bias:
                sd[f"layers.{i}.wqkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
            sd[f"layers.{i}.wo.weight"] = take(p + "self_attn.o_proj.weight")
            sd[f"layers.{i}.ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
            sd[f"layers.{i}.w13.weight"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0
            )
            sd[f"layers.{i}.w2.weight"] = take(p + "mlp.down_proj.weight")
        sd["norm.weight"] = take("model.norm.weight")
        if args.tie_word_embeddings:
            head = state_dict.get("lm_head.weight")
            if head is not None:  # a tied model's state dict may list the shared matrix twice
                used.add("lm_head.weight")
                same = head.data_ptr() == embed.data_ptr() or (head.shape == embed.shape and torch.equal(head, embed))
                if not same:
                    raise ValueError(
                        "tie_word_embeddings=True but the state dict's lm_head.weight differs from "
                        "model.embed_tokens.weight (which one is the head?)"
                    )
            sd["output.weight"] = embed
        else:
            sd["output.weight"] = take("lm_head.weight")
        extra = sorted(k for k in state_dict if k not in used and not k.endswith("rotary_emb.inv_freq"))
        if extra:
            more = f" ... ({len(extra)} in all)" if len(extra) > 8 else ""
            raise ValueError(
                f"the state dict holds weights a {config.model_type} model of {args.num_layers} layers "
                f"does not use (ignoring them would run a different model): {extra[:8]}{more}"
            )
        sd = {k: v.detach().to(dtype=dtype) for k, v in sd.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
        if missing or unexpected:
            raise KeyError(f"state dict does not fit the model: missing {missing}, unexpected {unexpected}")
        rope = _rope_parameters(config)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            exponent = torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim
            inv_freq, scaling = 1.0 / (args.rope_theta**exponent), 1.0
        else:  # scaled variants (linear, llama3, yarn): transformers computes the frequencies
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            rotary = LlamaRotaryEmbedding(config)
            inv_freq, scaling = rotary.inv_freq.float(), float(rotary.attention_scaling)
        model.inv_freq = inv_freq
        model.attention_scaling = scaling
        if pack and dtype == torch.float32 and os.environ.get(PACK_ENV, "1") != "0":
            model.pack_weights()
        return model.eval()

    @classmethod
    def from_hf_model(cls, hf_model, *, dtype: torch.dtype = torch.float32) -> "Transformer":
        """From a loaded transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
        ``MistralForCausalLM`` (its config and state dict; see ``from_hf``).

        Raises:
            TypeError: ``hf_model`` has no ``config`` / ``state_dict`` (not a transformers model).
            ValueError, KeyError: as ``from_hf``.
        """
        if not hasattr(hf_model, "config") or not callable(getattr(hf_model, "state_dict", None)):
            raise TypeError(
                f"hf_model must be a transformers causal LM (with .config and .state_dict()), got {type(hf_model).__name__}"
            )
        return cls.from_hf(hf_model.config, hf_model.state_dict(), dtype=dtype)

    def truncated(self, num_layers: int) -> "Transformer":
        """A separate model made of this one's first ``num_layers`` layers and its head.

        The weights are shared (no copy); the result is a model of its own, e.g. a small
        draft model for tests or a layer-skip style draft model with its own KV cache.

        Raises:
            ValueError: ``num_layers`` outside 1..num_layers.
        """
        if not 1 <= num_layers <= self.args.num_layers:
            raise ValueError(f"num_layers must lie in 1..{self.args.num_layers}, got {num_layers}")
        args = ModelArgs(**{**asdict(self.args), "num_layers": num_layers})
        with torch.device("meta"):
            small = Transformer(args)
        small.tok_embeddings = self.tok_embeddings
        small.layers = nn.ModuleList(list(self.layers[:num_layers]))
        small.norm, small.output = self.norm, self.output
        small.inv_freq, small.attention_scaling = self.inv_freq, self.attention_scaling
        small.attention_backend = self.attention_backend
        return small.eval()

    def pack_weights(self) -> Dict[str, str]:
        """Find the exact block-quantised form of each matrix-product weight (``decoding.packed``)
        and register it, so that ``linear`` can measure the packed path against ``F.linear``.

        Only a float32 CPU weight that its codes give back bit for bit is packed (SmolLM2 from
        its Q4_1 / Q8_0 GGUF: every one); the model's results do not change beyond the order of
        float32 additions.  One C++ pass over the weights (about 0.5 s for SmolLM2), and about 0.2
        bytes of memory per weight element.  Without the C++ extension nothing is packed.

        Returns:
            {parameter name: "affine4" | "scaled8" | "none"}.
        """
        kinds = {}
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and (name == "output" or name.startswith("layers.")):
                p = packed.pack_weight(module.weight)
                if p is not None:
                    packed.register(module.weight, p)
                else:
                    packed.unregister(module.weight)
                kinds[name + ".weight"] = packed.KIND_NAMES[p.kind] if p is not None else "none"
        return kinds

    # ------------------------------------------------------------------ inference
    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.output.weight.dtype

    def new_kv_cache(self, batch: int, capacity: int, num_layers: Optional[int] = None) -> torch.Tensor:
        """A zeroed KV cache ``[L, 2, batch, Hkv, capacity, D]`` in the model's dtype and device."""
        a = self.args
        L = a.num_layers if num_layers is None else num_layers
        return torch.zeros(L, 2, batch, a.num_kv_heads, capacity, a.head_dim, dtype=self.dtype, device=self.device)

    @torch.no_grad()  # an inference forward that writes its KV cache in place: never differentiated
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: Union[torch.Tensor, "PagedKVCache"],
        cache_seqlens: torch.Tensor,
        tree_mask: Optional[torch.Tensor] = None,
        *,
        num_layers: Optional[int] = None,
        logit_rows: Optional[torch.Tensor] = None,
        return_hidden: bool = False,
        compute_logits: bool = True,
    ):
        """Feed a block of N new tokens per sequence; return their next-token logits.

        Runs without autograd (``torch.no_grad``), inside or outside ``torch.inference_mode``.

        Args:
            tokens: Shape (B, N), int64: the block (for verification: root then drafts).
            positions: Shape (B, N), int64: rotary positions (``cache_seqlens + depth``).
            kv_cache: Shape (L', 2, B, Hkv, S, D), the model's dtype, L' >= the layers run.
                The block's keys and values are written at slots cache_seqlens[b] + i.  Or a
                ``paged.PagedKVCache`` (pool (L', 2, blocks, block_size, Hkv, D) and a block
                table of B rows): the same slots, written and read through the table.
            cache_seqlens: Shape (B,), int32: tokens already in the cache per sequence;
                cache_seqlens + N <= S.
            tree_mask: bool (N, N) or (B, N, N) ancestor mask of the block, None = chain.
            num_layers: run only the first layers (layer-skip drafting); the final norm and
                the head are applied after them.  None runs all.
            logit_rows: Shape (B, R), int64: compute logits only for these block rows (e.g.
                the last prompt token, or a tree's frontier).  None: all N rows.  R = 0 skips
                the head and returns None.
            return_hidden: also return the final hidden states of those rows (after the
                final norm, the head's input), e.g. for Medusa heads.
            compute_logits: False skips the head (logits None), e.g. when only the hidden
                states are wanted.

        Returns:
            logits: Shape (B, N or R, vocab), float32, or None when R = 0 or
            ``compute_logits`` is False.  With ``return_hidden`` a pair ``(logits, hidden)``,
            hidden of shape (B, N or R, hidden_size) in the model's dtype (None when R = 0).
        """
        B, N = tokens.shape
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        cos = (emb.cos() * self.attention_scaling).to(self.dtype)
        sin = (emb.sin() * self.attention_scaling).to(self.dtype)
        seqlens = cache_seqlens.to(torch.int32)

        block_table = None
        if isinstance(kv_cache, PagedKVCache):  # writes through the block table, into the pool
            block_table = kv_cache.block_table
            flat = kv_cache.physical_slots(cache_seqlens, N)
            Hkv, D = self.args.num_kv_heads, self.args.head_dim

            def write(cache, new):  # cache [blocks, block_size, Hkv, D], new [B, N, Hkv, D]
                cache.view(-1, Hkv, D).index_copy_(0, flat, new.reshape(B * N, Hkv, D))

            x = self.tok_embeddings(tokens)
            for i, layer in enumerate(layers):
                x = layer(x, cos, sin, kv_cache.pool[i], write, seqlens, tree_mask, self.attention_backend, block_table)
            return self._head(x, logit_rows, return_hidden, compute_logits)

        # Slot writes: one slice when every sequence starts at the same slot, else a scatter.
        starts = cache_seqlens.tolist() if cache_seqlens.device.type == "cpu" else None
        if starts is not None and min(starts) == max(starts):
            s = starts[0]

            def write(cache, new):  # cache [B, Hkv, S, D], new [B, N, Hkv, D]
                cache[:, :, s : s + N] = new.transpose(1, 2)

        else:
            b_idx = torch.arange(B, device=tokens.device)[:, None]
            slots = cache_seqlens.to(torch.int64)[:, None] + torch.arange(N, device=tokens.device)

            def write(cache, new):
                cache[b_idx, :, slots] = new

        # On CPU, attend over the used part of the cache only (the reference is dense in S).
        if starts is not None:
            kv_cache = kv_cache[..., : max(starts, default=0) + N, :]

        x = self.tok_embeddings(tokens)
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, kv_cache[i], write, seqlens, tree_mask, self.attention_backend)
        return self._head(x, logit_rows, return_hidden, compute_logits)

    def _head(self, x, logit_rows, return_hidden, compute_logits):
        """The final norm and the LM head over the wanted rows (see ``forward``)."""
        if logit_rows is not None:
            if logit_rows.shape[1] == 0:
                return (None, None) if return_hidden else None
            x = x.gather(1, logit_rows[..., None].expand(-1, -1, x.shape[-1]))
        if not return_hidden:
            return linear(self.norm(x), self.output.weight).float() if compute_logits else None
        hidden = self.norm(x)
        return (linear(hidden, self.output.weight).float() if compute_logits else None), hidden
