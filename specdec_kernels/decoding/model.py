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

import contextlib
import functools
import os
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from specdec_kernels import SUPPORTED_HEAD_DIMS
from specdec_kernels.autotune import RuntimeChoice
from specdec_kernels.checks import layer_indices
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


class _HFWeights:
    """The weights of a transformers state dict taken by name (``from_hf``), remembering which."""

    def __init__(self, config, args: ModelArgs, state_dict) -> None:
        self.config, self.args, self.state_dict = config, args, state_dict
        self.used = set()

    def take(self, name: str) -> torch.Tensor:
        """The weight ``name``.  Raises KeyError when the state dict has none."""
        if name not in self.state_dict:
            model_type, num_layers = self.config.model_type, self.args.num_layers
            raise KeyError(f"state dict has no {name!r} (needed by a {model_type} model of {num_layers} layers)")
        self.used.add(name)
        return self.state_dict[name]

    def output(self, embed: torch.Tensor) -> torch.Tensor:
        """The LM head: the embeddings of a tied model (checked against a listed lm_head.weight),
        else lm_head.weight.  Raises ValueError when a tied model's lm_head.weight differs."""
        if not self.args.tie_word_embeddings:
            return self.take("lm_head.weight")
        head = self.state_dict.get("lm_head.weight")
        if head is not None:  # a tied model's state dict may list the shared matrix twice
            self.used.add("lm_head.weight")
            same = head.data_ptr() == embed.data_ptr() or (head.shape == embed.shape and torch.equal(head, embed))
            if not same:
                raise ValueError(
                    "tie_word_embeddings=True but the state dict's lm_head.weight differs from "
                    "model.embed_tokens.weight (which one is the head?)"
                )
        return embed

    def check_all_used(self) -> None:
        """Raises ValueError naming the weights no ``take`` asked for (rotary buffers aside)."""
        extra = sorted(k for k in self.state_dict if k not in self.used and not k.endswith("rotary_emb.inv_freq"))
        if extra:
            more = f" ... ({len(extra)} in all)" if len(extra) > 8 else ""
            raise ValueError(
                f"the state dict holds weights a {self.config.model_type} model of {self.args.num_layers} layers "
                f"does not use (ignoring them would run a different model): {extra[:8]}{more}"
            )


def _hf_weights(config, args: ModelArgs, state_dict) -> Dict[str, torch.Tensor]:
    """``Transformer``'s state dict from a transformers ``*ForCausalLM``'s (``from_hf``): q/k/v
    (and their biases) and gate/up concatenated; the tensors are ``state_dict``'s or new.

    Raises:
        KeyError: a weight missing from ``state_dict``.
        ValueError: weights left over, or a tied lm_head.weight that differs from the embeddings.
    """
    hf = _HFWeights(config, args, state_dict)
    take = hf.take
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
    sd["output.weight"] = hf.output(embed)
    hf.check_all_used()
    return sd


def _hf_rotary(config, args: ModelArgs) -> Tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) of a transformers config (``from_hf``): plain RoPE computed
    here; the scaled variants (linear, llama3, yarn) by transformers' ``LlamaRotaryEmbedding``."""
    rope = _rope_parameters(config)
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        exponent = torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim
        return 1.0 / (args.rope_theta**exponent), 1.0
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


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


ROW_INDEPENDENT_ROWS = 64  # CPU passes of up to this many tokens per sequence take the one-call layer
LINEAR_ENV = "SPECDEC_LINEAR"  # "auto" (default) or "f_linear" (every float32 product through F.linear)
NUMERICS = ("float32", "int8")
NUMERICS_ENV = "SPECDEC_NUMERICS"  # the default of Transformer.numerics ("float32" or "int8")
PACK_ENV = "SPECDEC_PACK_WEIGHTS"  # "0": from_hf registers no packed weights


def default_numerics() -> str:
    """$SPECDEC_NUMERICS, else "float32": the numerics a new ``Transformer`` starts with.

    Raises:
        ValueError: the variable is set to something else.
    """
    value = os.environ.get(NUMERICS_ENV, "") or "float32"
    if value not in NUMERICS:
        raise ValueError(f"${NUMERICS_ENV} must be one of {NUMERICS}, got {value!r}")
    return value


def linear_path(rows: int, weight: torch.Tensor, numerics: str = "float32") -> str:
    """The path ``linear`` takes for a pass of ``rows`` tokens per sequence times ``weight``, by a
    fixed rule that depends on the weight and the numerics, not on the pass (never on a
    measurement, nor on ``rows`` beyond rows == 0), so that identical calls give identical bits
    and a row's product is the same in a decode step, a verification pass of any size, a prefill
    chunk of any size and any batch:

    * "int8": numerics "int8" and a float32 CPU weight with a registered packed form
      (``decoding.packed``): 8-bit activations;
    * "packed": numerics "float32" and a packed form: the exact float32 product read from the
      block-quantised codes;
    * "rowwise": numerics "float32", a float32 CPU weight without a packed form whose input size
      is a multiple of 32: ``packed.rowwise_linear``;
    * "f_linear": anything else (CUDA, other dtypes, no C++ extension, another input size, or
      $SPECDEC_LINEAR=f_linear for the float32 paths: BLAS, faster on long prefills, but a row may
      then round differently in passes of other sizes).

    The first three compute each row alone in one fixed order (``csrc/packed_linear_cpu.cpp``,
    ``csrc/packed_linear_int8_cpu.cpp``), so a row's output does not depend on the other rows of
    the pass or on their number: what keeps speculative output identical to greedy output, and a
    sequence's tokens independent of its batch, its prefill chunks and its cache layout.

    Raises:
        ValueError: an unknown ``numerics`` or $SPECDEC_LINEAR value.
    """
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    forced = os.environ.get(LINEAR_ENV, "") or "auto"
    if forced not in ("auto", "f_linear"):
        raise ValueError(f"${LINEAR_ENV} must be 'auto' or 'f_linear', got {forced!r}")
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or rows == 0 or not packed.has_kernel():
        return "f_linear"
    has_packed = packed.packed_form(weight) is not None
    if numerics == "int8" and has_packed and packed.has_kernel("packed_linear_int8"):
        return "int8"
    if forced == "f_linear":
        return "f_linear"
    if has_packed:
        return "packed"
    return "rowwise" if weight.shape[1] % packed.BLOCK == 0 else "f_linear"


def linear(x: torch.Tensor, weight: torch.Tensor, numerics: str = "float32", isa: Optional[str] = None) -> torch.Tensor:
    """``x @ weight.T`` (no bias), on the path ``linear_path`` gives (``isa``: the int8 path's
    instruction set, one of ``packed.int8_isas()``; None: the best this CPU runs).

    On CPU a decode or verify step multiplies a few rows by a large weight, which is bound by
    streaming the weight from memory: a weight with an exact block-quantised form
    (``decoding.packed``, SmolLM2's GGUF weights) is read in a fifth of the bytes, and with
    numerics "int8" its products use integer dot products (``packed.packed_linear_int8``).
    Where autograd records (grad enabled and x or the weight requiring grad, as when an EAGLE
    head's layer is trained) it is ``F.linear``: the native kernels have no backward.
    """
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight)  # training (an EAGLE head's layer): the native kernels have no backward
    rows = x.shape[-2] if x.dim() >= 3 else (x.numel() // x.shape[-1] if x.shape[-1] else 0)  # per sequence
    path = linear_path(rows if x.numel() else 0, weight, numerics)
    if path == "f_linear":
        return F.linear(x, weight)
    if path == "int8":
        return packed.packed_linear_int8(x, packed.int8_form(weight), isa=isa)
    if path == "packed":
        return packed.packed_linear(x, packed.packed_form(weight))
    return packed.rowwise_linear(x, weight)


INT8_ISA_ENV = "SPECDEC_INT8_ISA"  # forces the int8 products' instruction set ("avx2", "avx512-vnni", ...)
_INT8_ISA_CHOICE: list = []


def _int8_isa_choice() -> Optional[RuntimeChoice]:
    """The run-time choice of the int8 products' instruction set: the vector paths this CPU runs
    (the portable one only where there is none), the widest first, timed on whole passes per
    pass shape (tokens per sequence, threads, layers run) as they happen; None where there is
    nothing to choose.  Every path gives the same bits, so the choice changes speed only."""
    if not _INT8_ISA_CHOICE:
        every = list(packed.int8_isas())
        isas = [i for i in reversed(every) if i != "portable"] or every
        _INT8_ISA_CHOICE.append(
            RuntimeChoice("int8 products' instruction set", isas, trials=3, env=INT8_ISA_ENV, forceable=every)
            if isas
            else None
        )
    choice = _INT8_ISA_CHOICE[0]
    return choice if choice is not None and (len(choice.candidates) > 1 or choice.forced()) else None


def _measured_int8_isa(forward: Callable) -> Callable:
    """``Transformer.forward`` run with the int8 products' instruction set set on the model
    (``Transformer.set_int8_isa``): on CPU with int8 numerics the one ``_int8_isa_choice``
    measures fastest for the pass's shape (tokens per sequence rounded up to a power of 2,
    threads, layers run, whether every row's logits are computed), else None (the best)."""

    @functools.wraps(forward)
    def run(self: "Transformer", tokens: torch.Tensor, *args, **kwargs):
        choice = _int8_isa_choice() if self._numerics == "int8" and tokens.device.type == "cpu" else None
        if choice is None:
            self.set_int8_isa(None)
            return forward(self, tokens, *args, **kwargs)

        def under(isa: Optional[str]):
            self.set_int8_isa(isa)
            return forward(self, tokens, *args, **kwargs)

        n_class = 1 << max(0, tokens.shape[1] - 1).bit_length()
        layers = kwargs.get("num_layers") or len(self.layers)
        return choice((n_class, torch.get_num_threads(), layers, kwargs.get("logit_rows") is None), under)

    return run


FUSED_ENV = "SPECDEC_FUSED_LAYER"  # "0": every layer through the Python ops of Block.forward


def _linear_slots(path: str, weight: torch.Tensor) -> Tuple[int, List[Optional[torch.Tensor]], int]:
    """(kind, three weight slots, out features) of one linear for ``specdec_engine::decoder_layer``."""
    O = weight.shape[0]
    if path == "int8":
        w = packed.int8_form(weight)
        return (4 if w.kind == packed.AFFINE4 else 5), [w.qw, w.dw, w.mw], O
    if path == "packed":
        p = packed.packed_form(weight)
        return p.kind, [p.codes, p.scales, p.mins], O
    return (2 if path == "rowwise" else 3), [weight, None, None], O


def fused_layer_args(
    owner, weights: Sequence[torch.Tensor], numerics: str, rows: int, norms: Sequence[torch.Tensor] = ()
) -> Optional[tuple]:
    """The weight arguments of ``specdec_engine::decoder_layer`` for a layer whose linears are ``weights``
    (wqkv, wo, w13, w2) in a pass of ``rows`` tokens per sequence, or None where the layer runs
    its Python ops: the fused call needs the extension, float32 CPU weights (and ``norms``), at
    most ``ROW_INDEPENDENT_ROWS`` tokens, and $SPECDEC_FUSED_LAYER not "0".  Cached on ``owner``
    (a target layer, an EAGLE drafter) while the weights, the numerics and the packed registry
    stay the same."""
    checked = tuple(weights) + tuple(norms)
    key = (
        numerics,
        rows == 0,  # linear_path's rule for an empty pass differs
        rows <= ROW_INDEPENDENT_ROWS,
        packed.generation(),
        os.environ.get(LINEAR_ENV, ""),
        os.environ.get(FUSED_ENV, ""),
        tuple((-1 if w.is_inference() else w._version, w.data_ptr(), w.dtype, w.device) for w in checked),
    )
    cached = getattr(owner, "_fused_cache", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    args = None
    usable = (
        rows <= ROW_INDEPENDENT_ROWS
        and os.environ.get(FUSED_ENV, "") != "0"
        and all(w.device.type == "cpu" and w.dtype == torch.float32 for w in checked)
        and packed.has_kernel("decoder_layer")
    )
    if usable:
        slots = [_linear_slots(linear_path(rows, w, numerics), w) for w in weights]
        args = (
            [t for _, ts, _ in slots for t in ts],
            [k for k, _, _ in slots],
            [o for _, _, o in slots],
        )
    owner._fused_cache = (key, args)
    return args


def _global_forward_hooks() -> bool:
    """Whether a forward hook or pre-hook is registered on every module (``nn.modules.module.
    register_module_forward_hook`` and its pre-hook twin)."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _layer_state(layer: "Block") -> tuple:
    """A layer's (wqkv, wo, w13, w2 weights, attention and ffn norm weights, qkv bias or None) and
    (numerics, the two norms' eps), read from the modules' dicts (a tenth of the cost of attribute
    access: this runs per pass).

    Raises:
        KeyError: a layer whose linears or norms lack these parameters."""
    m = layer._modules
    qkv, an, fn = m["wqkv"]._parameters, m["attention_norm"], m["ffn_norm"]
    tensors = (
        qkv["weight"],
        m["wo"]._parameters["weight"],
        m["w13"]._parameters["weight"],
        m["w2"]._parameters["weight"],
        an._parameters["weight"],
        fn._parameters["weight"],
        qkv.get("bias"),
    )
    return tensors, (layer.__dict__.get("numerics"), an.__dict__.get("eps"), fn.__dict__.get("eps"))


def fused_stack_args(owner, layers: Sequence["Block"], rows: int) -> Optional[tuple]:
    """The arguments of ``specdec_engine::decoder_stack`` for ``layers`` in a pass of ``rows``
    tokens per sequence: (norms, qkv biases, weight slots, kinds, out features, eps), each layer's
    as its ``Block.fused_args`` gives them; None where some layer runs its Python ops (its
    ``fused_args`` is None, its modules are not plain ``Block`` ones), or its eps differs from
    the first layer's (the call takes one eps).  Cached on ``owner`` while every layer's weights
    (the same tensors, data and versions), numerics, eps, the packed registry and the environment
    stay the same: one check per pass instead of one per layer.  None also where a layer would
    not run its own ``Block.forward`` alone: a forward hook or pre-hook on it (a recorder of its
    outputs) or on every module, a subclass, a ``forward`` replaced."""
    if _global_forward_hooks() or not all(
        type(layer) is Block and not (layer._forward_hooks or layer._forward_pre_hooks or "forward" in layer.__dict__)
        for layer in layers
    ):
        return None
    if Block.forward is not _BLOCK_FORWARD:  # replaced on the class (a test's spy, a patch)
        return None
    try:
        states = [_layer_state(layer) for layer in layers]
    except KeyError:
        return None
    flat = [t for tensors, _ in states for t in tensors if t is not None]
    try:
        versions = tuple([t._version for t in flat])
    except RuntimeError:  # inference tensors keep no version counter (never modified in place)
        versions = tuple(-1 if t.is_inference() else t._version for t in flat)
    key = (
        rows == 0,  # linear_path's rule for an empty pass differs
        rows <= ROW_INDEPENDENT_ROWS,
        packed.generation(),
        os.environ.get(LINEAR_ENV, ""),
        os.environ.get(FUSED_ENV, ""),
        tuple([settings for _, settings in states]),
        tuple(map(id, flat)),
        tuple([t.data_ptr() for t in flat]),
        versions,
    )
    cached = getattr(owner, "_stack_cache", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    args = None
    fused = [layer.fused_args(rows) for layer in layers]
    eps = states[0][1][1] if states else 0.0
    if all(f is not None for f in fused) and all(s[1] == eps for _, s in states):
        args = (
            [t for tensors, _ in states for t in tensors[4:6]],
            [tensors[6] for tensors, _ in states],
            [w for f in fused for w in f[0]],
            [k for f in fused for k in f[1]],
            [o for f in fused for o in f[2]],
            eps,
        )
    owner._stack_cache = (key, args)
    return args


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if (
                x.device.type == "cpu"
                and self.weight.device.type == "cpu"
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                and packed.has_kernel("rms_norm")
            ):
                # the loop of the one-call layer (specdec_engine::decoder_layer): every CPU path of a pass
                # (one-call or Python layer, dense or paged, any rows) rounds alike
                return torch.ops.specdec_engine.rms_norm(x, self.weight, self.eps)
            # one op (transformers' arithmetic in float32: x * rsqrt(mean(x^2) + eps) * weight)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of gate_up (..., 2 I), gate first (Shazeer 2020, "GLU Variants
    Improve Transformer"): (..., I).  float32 on CPU outside autograd: the loop of the one-call
    layer (``specdec_engine::silu_mul``, the same bits as ``decoder_layer`` and every CPU path of
    a pass); else ``F.silu(gate) * up``."""
    if (
        gate_up.dtype == torch.float32
        and gate_up.device.type == "cpu"
        and not (torch.is_grad_enabled() and gate_up.requires_grad)
        and packed.has_kernel("silu_mul")
    ):
        return torch.ops.specdec_engine.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
        self.numerics = "float32"  # set through Transformer.numerics
        self.isa: Optional[str] = None  # the int8 products' instruction set of the current pass (None: the best)

    def fused_args(self, rows: int) -> Optional[tuple]:
        """The weight arguments of ``specdec_engine::decoder_layer`` for a pass of ``rows`` tokens per
        sequence, or None where the layer runs its Python ops (``fused_layer_args``; and where its
        norms are not both ``RMSNorm`` with one eps: the one-call layer computes RMSNorm's
        arithmetic with one eps)."""
        an, fn = self.attention_norm, self.ffn_norm
        if type(an) is not RMSNorm or type(fn) is not RMSNorm or an.eps != fn.eps:
            return None
        return fused_layer_args(
            self, (self.wqkv.weight, self.wo.weight, self.w13.weight, self.w2.weight), self.numerics, rows
        )

    def forward(self, x, cos, sin, layer_cache, write, cache_seqlens, tree_mask, backend, block_table=None):
        B, N, _ = x.shape
        differentiable = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in self.parameters())
        )
        if (
            block_table is None
            and backend in (None, "native")
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not differentiable  # training a head's layer: the Python ops, which autograd follows
        ):
            fused = self.fused_args(N)
            if fused is not None:  # the same ops in one native call (csrc/decoder_layer_cpu.cpp)
                return torch.ops.specdec_engine.decoder_layer(
                    x,
                    self.attention_norm.weight,
                    self.ffn_norm.weight,
                    self.attention_norm.eps,
                    cos,
                    sin,
                    layer_cache[0],
                    layer_cache[1],
                    cache_seqlens,
                    tree_mask,
                    self.wqkv.bias,
                    *fused,
                    self.args.num_heads,
                    self.args.num_kv_heads,
                    packed.isa_code(self.isa),
                )
        H, Hkv, D = self.args.num_heads, self.args.num_kv_heads, self.args.head_dim
        nx = self.numerics
        isa = self.isa
        qkv = linear(self.attention_norm(x), self.wqkv.weight, nx, isa)
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
        x = x + linear(attn.reshape(B, N, H * D), self.wo.weight, nx, isa)
        return x + linear(swiglu(linear(self.ffn_norm(x), self.w13.weight, nx, isa)), self.w2.weight, nx, isa)


_BLOCK_FORWARD = Block.forward  # what fused_stack_args stands in for


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
        self.numerics = default_numerics()
        self._isa: Optional[str] = None

    @property
    def numerics(self) -> str:
        """The arithmetic of the CPU matrix products (``linear_path``): "float32" (the model's own
        float32 products, as transformers computes them but for the order of additions) or
        "int8" (8-bit activations against the packed GGUF codes, llama.cpp's arithmetic; only
        weights with a packed form, see ``pack_weights``).  Both keep every row of a pass
        independent of the others, so speculative output equals greedy output in either.
        Setting it sets every layer's (layers shared with ``truncated`` models included).

        Raises:
            ValueError: set to anything else.
        """
        return self._numerics

    @numerics.setter
    def numerics(self, value: str) -> None:
        if value not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {value!r}")
        self._numerics = value
        for layer in self.layers:
            layer.numerics = value

    @contextlib.contextmanager
    def numerics_as(self, value: str) -> Iterator[None]:
        """``with model.numerics_as("int8"):`` runs the block in those numerics and gives the
        model its own back afterwards, also when the block raises.

        Raises:
            ValueError: an unknown ``value`` (before the block runs).
        """
        own = self.numerics
        self.numerics = value
        try:
            yield
        finally:
            self.numerics = own

    @contextlib.contextmanager
    def weights_fixed(self) -> Iterator[None]:
        """``with model.weights_fixed():`` the block's passes take the model's layers as fixed:
        the arguments of the native stack (``fused_stack_args``) are gathered once per pass
        shape class, numerics and environment, not checked again every pass.  Outside it every
        pass checks every layer's weights (identity, data pointer and version), norms, hooks
        and class, about 0.15 ms of Python a pass (0.4-0.5 ms just after a pass has streamed the
        weights through the caches).  The engine decodes a generation in it
        (``SpeculativeDecoder.generate``): weights replaced or edited in place, norms changed or
        hooks registered while it runs are seen from the next one (a weight edited in place is
        still read in place by the float32 paths, but not re-packed for the int8 ones).
        Nested blocks share the outer one's arguments; the model's own checks come back after
        the outermost block, also when it raises."""
        outer = self.__dict__.get("_fixed_stack")
        if outer is None:
            self._fixed_stack = {}
        try:
            yield
        finally:
            if outer is None:
                self._fixed_stack = None

    def _stack_args(self, rows: int) -> Optional[tuple]:
        """``fused_stack_args`` for a pass of ``rows`` tokens per sequence, from the fixed
        arguments inside ``weights_fixed``."""
        fixed = self.__dict__.get("_fixed_stack")
        if fixed is None:
            return fused_stack_args(self, self.layers, rows)
        key = (
            self._numerics,
            rows == 0,
            rows <= ROW_INDEPENDENT_ROWS,
            packed.generation(),
            os.environ.get(LINEAR_ENV, ""),
            os.environ.get(FUSED_ENV, ""),
        )
        if key not in fixed:
            fixed[key] = fused_stack_args(self, self.layers, rows)
        return fixed[key]

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
        then reads (see ``linear_path``); $SPECDEC_PACK_WEIGHTS=0 turns this off.  Moving the
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
        sd = {k: v.detach().to(dtype=dtype) for k, v in _hf_weights(config, args, state_dict).items()}
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
        if missing or unexpected:
            raise KeyError(f"state dict does not fit the model: missing {missing}, unexpected {unexpected}")
        model.inv_freq, model.attention_scaling = _hf_rotary(config, args)
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
        small.numerics = self.numerics
        return small.eval()

    def pack_weights(self) -> Dict[str, str]:
        """Find the exact block-quantised form of each matrix-product weight (``decoding.packed``)
        and register it, so that ``linear`` reads it (``linear_path``: the "packed" and "int8" paths).

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

    def set_int8_isa(self, isa: Optional[str]) -> None:
        """The instruction set of the int8 products of the layers' next passes (a name from
        ``packed.int8_isas()``; None: the best this CPU runs).  Every choice gives the same bits.
        ``forward`` sets it itself on every CPU pass with int8 numerics, from the timed choice
        per pass shape; to force one there, set $SPECDEC_INT8_ISA (any name of ``int8_isas()``,
        "portable" included).

        Raises:
            ValueError: a name this CPU does not run."""
        if isa is not None and isa not in packed.int8_isas():
            raise ValueError(f"isa must be None or one of {packed.int8_isas()} on this CPU, got {isa!r}")
        self._isa = isa
        for layer in self.layers:
            if layer.__dict__.get("isa", 0) != isa:  # read per pass: set only what changed
                layer.isa = isa

    @torch.no_grad()  # an inference forward that writes its KV cache in place: never differentiated
    @_measured_int8_isa
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
        hidden_layers: Sequence[int] = (),
        host_seqlens: Optional[Sequence[int]] = None,
    ):
        """Feed a block of N new tokens per sequence; return their next-token logits.  Runs without
        autograd (``torch.no_grad``), inside or outside ``torch.inference_mode``.

        Args:
            tokens: Shape (B, N), int64: the block (for verification: root then drafts).
            positions: Shape (B, N), int64: rotary positions (``cache_seqlens + depth``).
            kv_cache: Shape (L', 2, B, Hkv, S, D), the model's dtype, L' >= the layers run; the block's keys and
                values are written at slots cache_seqlens[b] + i.  Or a ``paged.PagedKVCache`` (pool (L', 2,
                blocks, block_size, Hkv, D), a block table of B rows): the same slots, through the table.
            cache_seqlens: Shape (B,), int32: tokens already in the cache per sequence; cache_seqlens + N <= S.
            tree_mask: bool (N, N) or (B, N, N) ancestor mask of the block, None = chain.
            num_layers: run only the first layers (layer-skip drafting); the final norm and the head are applied
                after them.  None runs all.
            logit_rows: Shape (B, R), int64: compute logits only for these block rows (e.g. the last prompt
                token, or a tree's frontier).  None: all N rows.  R = 0 skips the head and returns None.
            return_hidden: also return the final hidden states of those rows (after the final norm, the
                head's input), e.g. for Medusa heads.
            compute_logits: False skips the head (logits None), e.g. when only the hidden states are wanted.
            hidden_layers: with ``return_hidden``, also the outputs of these layers (0-based indices among
                the layers run, each its residual stream before any norm), appended to the final hidden state
                in this order: EAGLE-3's low-, mid- and high-level features (Li et al. 2025, "EAGLE-3: Scaling
                up Inference Acceleration of Large Language Models via Training-Time Test").
            host_seqlens: cache_seqlens' values as the caller keeps them on the host (the engine loop does),
                or None (``_slot_writes``: which slot writes each takes).

        Returns:
            logits: Shape (B, N or R, vocab), float32, or None when R = 0 or ``compute_logits`` is False.
            With ``return_hidden`` a pair ``(logits, hidden)``, hidden of shape (B, N or R, hidden_size *
            (1 + len(hidden_layers))) in the model's dtype (None when R = 0).

        Raises:
            ValueError: a ``hidden_layers`` index outside the layers run, or repeated.
            TypeError: ``hidden_layers`` not a sequence of ints.
        """
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        taps = layer_indices("hidden_layers", hidden_layers, len(layers))
        cos, sin = self._rotary(positions)
        seqlens = cache_seqlens.to(torch.int32)
        caches, write, block_table = self._slot_writes(tokens, kv_cache, cache_seqlens, host_seqlens)
        x, kept = self.tok_embeddings(tokens), {}
        stack = (
            self._stack_args(tokens.shape[1])
            if block_table is None
            and self.attention_backend in (None, "native")
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            else None
        )
        if stack is not None:  # every layer in native calls: one per run of layers between taps
            x = self._run_stack(x, stack, len(layers), taps, kept, cos, sin, caches, seqlens, tree_mask)
        else:
            for i, layer in enumerate(layers):
                x = layer(x, cos, sin, caches[i], write, seqlens, tree_mask, self.attention_backend, block_table)
                if i in taps:
                    kept[i] = x
        return self._head(x, logit_rows, return_hidden, compute_logits, [kept[i] for i in taps])

    def _run_stack(self, x, stack, n, taps, kept, cos, sin, caches, seqlens, tree_mask) -> torch.Tensor:
        """Layers 0 .. n - 1 by ``specdec_engine::decoder_stack`` (``fused_stack_args``' ``stack``
        for all the model's layers), one call per run of layers up to each tap, whose output goes
        into ``kept``: the same calls, in the same order, as the layers' ``Block.forward``."""
        norms, biases, weights, kinds, outs, eps = stack
        a, isa = self.args, packed.isa_code(self._isa)
        start = 0
        for end in sorted(set(taps)) + [n - 1]:
            if end >= start:
                x = torch.ops.specdec_engine.decoder_stack(
                    x,
                    norms[2 * start : 2 * end + 2],
                    eps,
                    cos,
                    sin,
                    caches[start:],
                    seqlens,
                    tree_mask,
                    biases[start : end + 1],
                    weights[12 * start : 12 * end + 12],
                    kinds[4 * start : 4 * end + 4],
                    outs[4 * start : 4 * end + 4],
                    a.num_heads,
                    a.num_kv_heads,
                    isa,
                )
                start = end + 1
            if end in taps:
                kept[end] = x
        return x

    def _rotary(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s rotary tables for positions (B, N): cos and sin (B, N, 1, head_dim) in the
        model's dtype, scaled by ``attention_scaling``."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        cos = (emb.cos() * self.attention_scaling).to(self.dtype)
        sin = (emb.sin() * self.attention_scaling).to(self.dtype)
        return cos, sin

    def _slot_writes(self, tokens, kv_cache, cache_seqlens, host_seqlens):
        """How ``forward`` writes the block's keys and values at slots cache_seqlens[b] + i:
        (the per-layer caches, ``write(cache, new)`` with new (B, N, Hkv, D), the block table or None).

        A ``PagedKVCache``: the writes go through its block table into the pool.  Else one slice
        when every sequence starts at the same slot, otherwise a scatter.  ``host_seqlens`` given,
        the starts are read from it, never from cache_seqlens; None reads cache_seqlens on CPU
        only (on a GPU the writes scatter, reading nothing, as a captured graph needs).  With
        known starts (on CPU), the layers attend over the used part of the cache only (the
        reference is dense in S)."""
        B, N = tokens.shape
        if isinstance(kv_cache, PagedKVCache):  # writes through the block table, into the pool
            flat = kv_cache.physical_slots(cache_seqlens, N)
            Hkv, D = self.args.num_kv_heads, self.args.head_dim

            def write(cache, new):  # cache [blocks, block_size, Hkv, D], new [B, N, Hkv, D]
                cache.view(-1, Hkv, D).index_copy_(0, flat, new.reshape(B * N, Hkv, D))

            return kv_cache.pool, write, kv_cache.block_table

        if host_seqlens is not None:
            starts = [int(v) for v in host_seqlens]
        else:
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

        if starts is not None:  # on CPU, attend over the used part of the cache only
            kv_cache = kv_cache[..., : max(starts, default=0) + N, :]
        return kv_cache, write, None

    def _head(self, x, logit_rows, return_hidden, compute_logits, extra=()):
        """The final norm and the LM head over the wanted rows (see ``forward``); ``extra``:
        layer outputs appended to the returned hidden states."""
        if logit_rows is not None:
            if logit_rows.shape[1] == 0:
                return (None, None) if return_hidden else None
            rows = logit_rows[..., None].expand(-1, -1, x.shape[-1])
            x = x.gather(1, rows)
            extra = [e.gather(1, rows) for e in extra]
        if not return_hidden:
            return (
                linear(self.norm(x), self.output.weight, self._numerics, self._isa).float() if compute_logits else None
            )
        hidden = self.norm(x)
        logits = linear(hidden, self.output.weight, self._numerics, self._isa).float() if compute_logits else None
        return logits, (torch.cat([hidden, *extra], dim=-1) if extra else hidden)
