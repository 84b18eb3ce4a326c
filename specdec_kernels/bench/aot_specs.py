"""Ahead-of-time compilation specs of the Triton kernels, built from the launchers' own
``launch_config`` (no GPU needed).

A spec is a dict: ``kernel`` (the @triton.jit function), ``name``, ``signature`` (argument name
-> Triton type string such as "*fp32", "i32" or "constexpr"), ``constexprs`` (name -> value) and
``options`` (``num_warps``).  The tile sizes, warps and chunk counts in it come from a
launcher's ``launch_config`` at a given shape and SM count, so a spec is what that launcher
would launch there; the argument types are the ones the launchers pass.

- ``AOT_SPECS``: per module of ``specdec_kernels.ops._triton``, the configurations that
  ``tests/ops/aot_compile.py`` compiles for sm_80 and sm_90: every dtype and layout combination
  that changes a kernel's signature, at shapes that reach the small and the large tiles.
- The ``*_spec(s)`` builders, which ``specdec_kernels/bench/static.py`` calls at realistic shapes.

Importing this module imports triton (the kernels are JIT functions).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from specdec_kernels.ops._triton import _uniforms as un
from specdec_kernels.ops._triton import rejection_sample as rs
from specdec_kernels.ops._triton import sampling_probs as sp
from specdec_kernels.ops._triton import tree_attention as ta
from specdec_kernels.ops._triton import tree_rejection_sample as trs
from specdec_kernels.ops._triton import verify_greedy as vg
from specdec_kernels.ops._triton import verify_tree_greedy as vtg

# The SM count the configurations are chosen for: H100 / H200 SXM.
TARGET_SM_COUNT = 132


def _unique(specs) -> List[dict]:
    """``specs`` without repeats (the first spec of each name)."""
    seen: Dict[str, dict] = {}
    for s in specs:
        seen.setdefault(s["name"], s)
    return list(seen.values())


def _spec(
    kernel, name: str, args: Dict[str, str], constexprs: Dict[str, object], num_warps: Optional[int] = None
) -> dict:
    """The spec of ``kernel`` named ``name``: its signature is ``args`` (the runtime arguments, in
    the kernel's order, -> Triton type) followed by the names of ``constexprs`` typed "constexpr";
    ``options`` (``num_warps``) only when ``num_warps`` is given."""
    spec = {
        "kernel": kernel,
        "name": name,
        "signature": {**args, **dict.fromkeys(constexprs, "constexpr")},
        "constexprs": constexprs,
    }
    if num_warps is not None:
        spec["options"] = {"num_warps": num_warps}
    return spec


# --------------------------------------------------------------------------------------
# verify_greedy, verify_tree_greedy
# --------------------------------------------------------------------------------------


# the argmax partials (values, then the indices' int32 bits, one fp32 workspace) that
# ``_argmax_partials_kernel`` writes and the accept and tree-walk kernels read
PARTIALS = {"part_ptr": "*fp32"}
# the accept kernel's variants: (draft ids, counts, flat, bonus_ids): padded (counts int64),
# flattened with vLLM's int32 ids and cu and with int64, bonus rows or ids
ACCEPT_VARIANTS = (
    ("i32", "i64", False, False),
    ("i64", "i64", False, False),
    ("i32", "i32", True, False),
    ("i32", "i32", True, True),
    ("i64", "i64", True, True),
)


def argmax_spec(dtype: str, cfg: vg.ArgmaxLaunch, name: str) -> dict:
    """``_argmax_partials_kernel`` over ``dtype`` ("fp32", "fp16", "bf16") logits."""
    return _spec(
        vg._argmax_partials_kernel,
        name,
        {
            "logits_ptr": f"*{dtype}",
            **PARTIALS,
            "R": "i32",
            "V": "i32",
            "stride_b": "i64",
            "stride_r": "i32",
            "TILES_PER_SPLIT": "i32",
        },
        {"BLOCK_V": cfg.block_v},
        cfg.num_warps,
    )


def accept_spec(ids: str, cu: str, flat: bool, bonus_ids: bool, cfg: vg.VerifyGreedyLaunch) -> dict:
    """``_verify_greedy_accept_kernel`` with ``ids`` drafts and ``cu`` counts ("i32"/"i64")."""
    return _spec(
        vg._verify_greedy_accept_kernel,
        f"verify_greedy._verify_greedy_accept_kernel[{ids}, cu {cu}, flat={flat}, bonus_ids={bonus_ids}]",
        {
            **PARTIALS,
            "draft_ptr": f"*{ids}",
            "stride_db": "i32",
            "stride_dk": "i32",
            "num_draft_ptr": f"*{cu}",
            "bonus_ptr": f"*{cu}",
            "out_ptr": "*i64",
            "num_accepted_ptr": "*i64",
            "K": "i32",
            "S": "i32",
            "num_rows": "i32",
            "T": "i32",
        },
        {"FLAT": flat, "BONUS_IDS": bonus_ids, "BLOCK_K": cfg.block_k},
        cfg.num_warps,
    )


def tree_walk_spec(ids: str, cfg: vtg.VerifyTreeGreedyLaunch, suffix: str = "") -> dict:
    """``_verify_tree_greedy_walk_kernel`` with ``ids`` tree tokens ("i32"/"i64")."""
    return _spec(
        vtg._verify_tree_greedy_walk_kernel,
        f"verify_tree_greedy._verify_tree_greedy_walk_kernel[{ids}]{suffix}",
        {
            **PARTIALS,
            "tokens_ptr": f"*{ids}",
            "stride_tb": "i32",
            "stride_tn": "i32",
            "parents_ptr": "*i64",
            "stride_pb": "i32",
            "stride_pn": "i32",
            "num_nodes_ptr": "*i64",
            "out_tokens_ptr": "*i64",
            "accepted_nodes_ptr": "*i64",
            "num_accepted_ptr": "*i64",
            "N": "i32",
            "S": "i32",
        },
        {"BLOCK_N": cfg.block_n},
        cfg.num_warps,
    )


# --------------------------------------------------------------------------------------
# rejection_sample (padded and flattened)
# --------------------------------------------------------------------------------------


def rejection_specs(
    has_draft: bool,
    cfg: rs.RejectionSampleLaunch,
    prob: str = "*fp32",
    tok: str = "*i64",
    flat: bool = False,
    bonus_ids: bool = False,
    cu: str = "*i64",
    uniforms: str = "*fp32",
    philox: bool = False,
    keys: str = "*i64",
    padded_coins: bool = False,
) -> List[dict]:
    """The two kernels of one launch configuration (what ``_launch_chain`` passes): explicit
    ``uniforms`` ("*fp32"/"*fp64"; flattened coins [B, K] with ``padded_coins``), or with
    ``philox`` both computed from seeds and offsets of type ``keys`` (the uniform pointers then
    stand-ins of the counts' type)."""
    coins = final = cu if philox else uniforms
    block_b, block_v = cfg.vocab.block_b, cfg.vocab.block_v
    label = (
        f"draft={has_draft} {prob[1:]} {tok[1:]} BLOCK_B={block_b} BLOCK_V={block_v}"
        f" flat={flat} bonus_ids={bonus_ids} cu={cu[1:]}"
        + (f" philox keys={keys[1:]}" if philox else f" uniforms={uniforms[1:]} padded_coins={padded_coins}")
    )
    random_ptrs = {"seeds_ptr": keys if philox else cu, "offsets_ptr": keys if philox else cu}
    common = {"target_ptr": prob, "draft_ptr": prob, "tokens_ptr": tok, "num_draft_ptr": cu}
    strides = {
        "B": "i32",
        "K": "i32",
        "V": "i32",
        "T": "i32",
        "stride_tb": "i64",
        "stride_tk": "i32",
        "stride_db": "i64",
        "stride_dk": "i32",
    }
    flags = {"FLAT": flat, "BONUS_IDS": bonus_ids, "HAS_DRAFT": has_draft, "PHILOX_COINS": philox}
    flags["PADDED_COINS"] = padded_coins
    blocks = {"BLOCK_B": block_b, "BLOCK_V": block_v}
    partials = _spec(
        rs._rejection_partials_kernel,
        f"rejection_partials {label}",
        {
            **common,
            "coins_ptr": coins,
            **random_ptrs,
            "part_ptr": "*fp64",
            **strides,
            "TILES_PER_SPLIT": "i32",
        },
        {**flags, **blocks},
    )
    sample = _spec(
        rs._rejection_sample_kernel,
        f"rejection_sample {label} BLOCK_S={cfg.vocab.block_s}",
        {
            **common,
            "bonus_ptr": cu,
            "coins_ptr": coins,
            "final_u_ptr": final,
            **random_ptrs,
            "part_ptr": "*fp64",
            "out_ptr": "*i64",
            "num_accepted_ptr": "*i64",
            **strides,
            "S": "i32",
            "TILES_PER_SPLIT": "i32",
        },
        {**flags, "PHILOX_FINAL": philox, **blocks, "KP": cfg.kp, "BLOCK_S": cfg.vocab.block_s},
        cfg.sample_num_warps,
    )
    return [partials, sample]


# --------------------------------------------------------------------------------------
# sampling_probs
# --------------------------------------------------------------------------------------


def sampling_probs_specs(top_k: bool, top_p: bool, cfg: sp.SamplingProbsLaunch, dtype: str = "*fp32") -> List[dict]:
    """The two kernels the launcher runs for these settings (``cfg``: ``sp.launch_config``):
    the per-row search and the chunked write."""
    search = _spec(
        sp._sampling_search_kernel,
        f"sampling_probs search top_k={top_k} top_p={top_p} {dtype[1:]} BLOCK_V={cfg.search_block_v}",
        {
            "logits_ptr": dtype,
            "temp_ptr": "*fp32",
            "topk_ptr": "*i64",
            "topp_ptr": "*fp32",
            "row_ptr": "*i32",
            "V": "i32",
            "rows_per_seq": "i32",
            "stride_lr": "i64",
        },
        {
            "HAS_TOPK": top_k,
            "HAS_TOPP": top_p,
            "NP": sp.NPIV,
            "NUM_PASSES": sp.PASSES,
            "BITS": sp.RADIX_BITS,
            "BLOCK_V": cfg.search_block_v,
        },
        cfg.search_num_warps,
    )
    w = cfg.write
    write = _spec(
        sp._sampling_write_kernel,
        f"sampling_probs write {dtype[1:]} BLOCK_B={w.block_b} BLOCK_V={w.block_v}",
        {
            "logits_ptr": dtype,
            "out_ptr": "*fp32",
            "temp_ptr": "*fp32",
            "row_ptr": "*i32",
            "R": "i32",
            "V": "i32",
            "rows_per_seq": "i32",
            "stride_lr": "i64",
            "TILES_PER_SPLIT": "i32",
        },
        {"BLOCK_B": w.block_b, "BLOCK_V": w.block_v},
    )
    return [search, write]


# --------------------------------------------------------------------------------------
# tree_rejection_sample
# --------------------------------------------------------------------------------------


def tree_rejection_specs(
    has_draft: bool,
    cfg: trs.TreeRejectionSampleLaunch,
    prob: str = "*fp32",
    tok: str = "*i64",
    parent: str = "*i64",
    uniforms: str = "*fp32",
    philox: bool = False,
    keys: str = "*i64",
) -> List[dict]:
    """The two kernels of one launch configuration (what the launcher passes): the node masses
    over vocabulary chunks, and the walk with the final sample; explicit ``uniforms``
    ("*fp32"/"*fp64") or, with ``philox``, the numbers computed from seeds and offsets of type
    ``keys`` (the uniform pointers then stand-ins: the counts)."""
    uniform_ptr = "*i64" if philox else uniforms
    random_ptrs = {"seeds_ptr": keys if philox else "*i64", "offsets_ptr": keys if philox else "*i64"}
    random_label = f" philox keys={keys[1:]}" if philox else f" uniforms={uniforms[1:]}"
    ms = cfg.masses
    mass = _spec(
        trs._tree_mass_kernel,
        f"tree_mass {prob[1:]} BLOCK_R={ms.block_b} BLOCK_V={ms.block_v}",
        {
            "target_ptr": prob,
            "num_nodes_ptr": "*i64",
            "part_ptr": "*fp64",
            "R": "i32",
            "N": "i32",
            "V": "i32",
            "stride_tb": "i64",
            "stride_tn": "i32",
            "TILES_PER_SPLIT": "i32",
        },
        {"BLOCK_R": ms.block_b, "BLOCK_V": ms.block_v},
        cfg.mass_num_warps,
    )
    sample = _spec(
        trs._tree_sample_kernel,
        f"tree_sample draft={has_draft} {prob[1:]} {tok[1:]} {parent[1:]} BLOCK_B={cfg.sample_block_b} "
        f"BLOCK_V={cfg.sample_block_v} NP={cfg.np_}{random_label}",
        {
            "target_ptr": prob,
            "draft_ptr": prob,
            "tokens_ptr": tok,
            "parents_ptr": parent,
            "num_nodes_ptr": "*i64",
            "coins_ptr": uniform_ptr,
            "final_u_ptr": uniform_ptr,
            **random_ptrs,
            "part_ptr": "*fp64",
            "rej_ptr": "*i64",
            "out_tokens_ptr": "*i64",
            "out_nodes_ptr": "*i64",
            "num_accepted_ptr": "*i64",
            "B": "i32",
            "N": "i32",
            "V": "i32",
            "stride_tb": "i64",
            "stride_tn": "i32",
            "stride_db": "i64",
            "stride_dn": "i32",
            "stride_pb": "i32",
            "S": "i32",
        },
        {
            "HAS_DRAFT": has_draft,
            "PHILOX_COINS": philox,
            "PHILOX_FINAL": philox,
            "BLOCK_B": cfg.sample_block_b,
            "BLOCK_V": cfg.sample_block_v,
            "NP": cfg.np_,
        },
        cfg.sample_num_warps,
    )
    return [mass, sample]


# --------------------------------------------------------------------------------------
# tree_attention (dense and paged)
# --------------------------------------------------------------------------------------


def tree_attention_config(
    dtype: str, head_dim: int, rows: int = 64, split: bool = False, sm_count: int = TARGET_SM_COUNT
) -> ta.TreeAttentionLaunch:
    """The launch of one (sequence, KV head) with ``rows`` = G * N query rows, split over the
    prefix (two splits) or not, on a GPU."""
    return ta.launch_config(1, 1, rows, 1, head_dim, sm_count, ieee=dtype == "fp32", num_splits=2 if split else 1)


def tree_attention_fwd_spec(
    dtype: str,
    head_dim: int,
    mask_kind: int,
    cfg: ta.TreeAttentionLaunch,
    seqlen_dtype: str = "i32",
    paged: bool = False,
) -> dict:
    """``_tree_attention_fwd_kernel`` over ``dtype`` q/k/v with ``mask_kind`` (``ta.MASK_*``)."""
    split = cfg.num_splits > 1
    mask_ty = {ta.MASK_CAUSAL: "*" + seqlen_dtype, ta.MASK_BOOL: "*u8", ta.MASK_PACKED: "*i32"}[mask_kind]
    sig = {
        "Q": f"*{dtype}",
        "K": f"*{dtype}",
        "V": f"*{dtype}",
        "SEQLENS": f"*{seqlen_dtype}",
        "BLOCK_TABLE": "*i32" if paged else "*" + seqlen_dtype,
        "MASK": mask_ty,
        "OUT": f"*{dtype}",
        "OPART": "*fp32" if split else f"*{dtype}",
        "LSE": "*fp32" if split else f"*{dtype}",
        "N": "i32",
        "S_CAP": "i32",
        "G": "i32",
        "Hkv": "i32",
        "num_splits": "i32",
        "page_size": "i32",
        "num_blocks": "i32",
        "qk_scale": "fp32",
    }
    for prefix in ("q", "k", "v"):
        for dim in ("b", "h" if prefix != "q" else "n", "s" if prefix != "q" else "h", "d"):
            sig[f"stride_{prefix}{dim}"] = "i32"
    sig.update(
        {
            "stride_tb": "i32",
            "stride_tj": "i32",
            "stride_mb": "i32",
            "stride_mi": "i32",
            "stride_mj": "i32",
            "stride_ob": "i32",
            "stride_on": "i32",
            "stride_oh": "i32",
            "stride_od": "i32",
        }
    )
    constexprs = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=cfg.block_d,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        MASK_KIND=mask_kind,
        SPLIT=split,
        IEEE_DOT=dtype == "fp32",
        UPCAST_DOT=False,
        NUM_STAGES=ta.NUM_STAGES,
        PAGED=paged,
        MIN_SPLIT_KEYS=cfg.min_split_keys,
    )
    return _spec(
        ta._tree_attention_fwd_kernel,
        f"tree_attention.fwd[{dtype},D={head_dim},mask={mask_kind},split={int(split)},"
        f"BLOCK_M={cfg.block_m}{',paged' if paged else ''}]",
        sig,
        constexprs,
        cfg.num_warps,
    )


def tree_attention_combine_spec(
    dtype: str, head_dim: int, cfg: ta.TreeAttentionLaunch, seqlen_dtype: str = "i32"
) -> dict:
    """``_tree_attention_combine_kernel`` of a split launch."""
    sig = {
        "OPART": "*fp32",
        "LSE": "*fp32",
        "OUT": f"*{dtype}",
        "SEQLENS": f"*{seqlen_dtype}",
        "num_rows": "i32",
        "N": "i32",
        "S_CAP": "i32",
        "G": "i32",
        "Hkv": "i32",
        "num_splits": "i32",
        "stride_ob": "i32",
        "stride_on": "i32",
        "stride_oh": "i32",
        "stride_od": "i32",
    }
    return _spec(
        ta._tree_attention_combine_kernel,
        f"tree_attention.combine[{dtype},D={head_dim},seqlens={seqlen_dtype}]",
        sig,
        dict(ta.combine_constexprs(cfg, head_dim)),
        cfg.combine_num_warps,
    )


# --------------------------------------------------------------------------------------
# The specs tests/ops/aot_compile.py compiles, per module of specdec_kernels.ops._triton
# --------------------------------------------------------------------------------------


def _aot_specs() -> Dict[str, List[dict]]:
    sms = TARGET_SM_COUNT
    large_v, llama2_v = 128256, 32000  # Llama-3's and Llama-2's vocabularies
    specs: Dict[str, List[dict]] = {}

    # the largest argmax tile (every logits dtype); the accept kernel with 32 lanes (K = 31), in
    # each of its variants
    argmax = vg.argmax_launch_config(8, large_v, sms)
    accept = vg.launch_config(1, 32, 31, large_v, sms)
    specs["verify_greedy"] = [
        argmax_spec(f, argmax, f"verify_greedy._argmax_partials_kernel[{f}]") for f in ("fp32", "fp16", "bf16")
    ] + [accept_spec(i, c, flat, bonus_ids, accept) for i, c, flat, bonus_ids in ACCEPT_VARIANTS]
    # the per-node argmax is verify_greedy's kernel; the walk over 128 nodes
    walk = vtg.launch_config(1, 128, large_v, sms)
    specs["verify_tree_greedy"] = [tree_walk_spec(i, walk) for i in ("i32", "i64")]

    # batch 1 at a large vocabulary (126 chunks), large batches at Llama-2's (2 chunks), a
    # small vocabulary with 8 rows a program; padded, then the flattened (vLLM v1) layout with
    # int32 ids and cu as vLLM passes them, bonus rows or ids
    one = rs.launch_config(1, 15, large_v, sms)
    many = rs.launch_config(1024, 31, llama2_v, sms)
    small = rs.launch_config(8, 7, 128, sms)
    specs["rejection_sample"] = [
        s
        for group in (
            rejection_specs(True, one),
            rejection_specs(False, many, prob="*bf16", tok="*i32"),
            rejection_specs(True, small, prob="*fp16"),
            rejection_specs(True, rs.launch_config(1024, 15, llama2_v, sms), tok="*i32", flat=True, cu="*i32"),
            rejection_specs(False, many, prob="*bf16", tok="*i32", flat=True, bonus_ids=True, cu="*i32"),
            rejection_specs(True, small, prob="*fp16", flat=True, bonus_ids=True),
            # the randomness variants: seeds/offsets (int64, and vLLM-style int32 with int32
            # cu), float64 explicit uniforms, a flattened call with padded [B, K] coins
            rejection_specs(True, one, philox=True),
            rejection_specs(False, many, prob="*bf16", tok="*i32", flat=True, cu="*i32", philox=True, keys="*i32"),
            rejection_specs(True, small, prob="*fp16", uniforms="*fp64"),
            rejection_specs(True, small, flat=True, uniforms="*fp64", padded_coins=True),
        )
        for s in group
    ]

    # full 512-column tiles, and 4 and 16 rows a program (the write) at small vocabularies
    specs["sampling_probs"] = [
        s
        for group in (
            sampling_probs_specs(False, False, sp.launch_config(1, large_v, sms)),
            sampling_probs_specs(True, True, sp.launch_config(1, large_v, sms), "*bf16"),
            sampling_probs_specs(True, False, sp.launch_config(4, 128, sms), "*fp16"),
            sampling_probs_specs(False, True, sp.launch_config(16, 32, sms)),
        )
        for s in group
    ]

    # 8 trees of 64 nodes at a large vocabulary (node rows in 3 chunks, sequences in 126), with
    # and without draft distributions; 8 rows a program; 16 trees of 128 nodes, 16 rows a program
    big = trs.launch_config(8, 64, large_v, sms)
    # (the randomness variants share their node-mass kernel with the ones above: once each)
    specs["tree_rejection_sample"] = _unique(
        s
        for group in (
            tree_rejection_specs(True, big),
            tree_rejection_specs(
                False, trs.launch_config(8, 64, large_v, sms, has_draft=False), prob="*bf16", tok="*i32", parent="*i32"
            ),
            tree_rejection_specs(True, trs.launch_config(8, 8, 128, sms), prob="*fp16"),
            tree_rejection_specs(False, trs.launch_config(16, 128, 64, sms, has_draft=False)),
            # seeds/offsets (int64 and int32) and float64 explicit uniforms
            tree_rejection_specs(True, big, philox=True),
            tree_rejection_specs(
                False, trs.launch_config(8, 8, 128, sms, has_draft=False), tok="*i32", philox=True, keys="*i32"
            ),
            tree_rejection_specs(True, trs.launch_config(8, 8, 128, sms), uniforms="*fp64"),
        )
        for s in group
    )

    # the in-kernel Philox's debug path (the ops' helper in a kernel of its own)
    specs["_uniforms"] = [
        _spec(
            un._philox_debug_kernel,
            f"philox_debug keys={keys} STREAM={stream}",
            {"seeds_ptr": f"*{keys}", "offsets_ptr": f"*{keys}", "out_ptr": "*fp32", "B": "i32", "W": "i32"},
            {"STREAM": stream, "BLOCK_B": 16, "BLOCK_W": 64},
        )
        for keys, stream in (("i64", 0), ("i32", 1))
    ]

    def fwd(dtype, d, mask, split, seqlen="i32", rows=64, paged=False):
        return tree_attention_fwd_spec(dtype, d, mask, tree_attention_config(dtype, d, rows, split), seqlen, paged)

    def combine(dtype, d, seqlen="i32"):
        return tree_attention_combine_spec(dtype, d, tree_attention_config(dtype, d, split=True), seqlen)

    causal, dense, packed = ta.MASK_CAUSAL, ta.MASK_BOOL, ta.MASK_PACKED
    specs["tree_attention"] = (
        [fwd(dt, d, dense, False) for dt in ("fp16", "bf16", "fp32") for d in (16, 64, 80, 128, 256)]
        + [
            fwd("fp16", 64, causal, False),
            fwd("bf16", 128, packed, False),
            fwd("fp16", 96, packed, True),
            fwd("bf16", 64, causal, True, "i64"),
            fwd("fp32", 128, dense, True),
        ]
        # plain decoding (N = 1, G = 3 or 8 rows): the smallest row tile
        + [
            fwd("fp16", 64, causal, True, rows=3),
            fwd("bf16", 128, causal, False, rows=8),
            fwd("fp32", 64, causal, True, rows=3),
            fwd("bf16", 256, causal, True, rows=8),
        ]
        + [combine(dt, d) for dt, d in (("fp16", 64), ("bf16", 128), ("fp32", 80), ("fp16", 256))]
        + [combine("bf16", 64, "i64")]
        # paged KV cache (PAGED: block-table lookup per key tile), every mask kind, split and not
        + [
            fwd("fp16", 64, dense, False, paged=True),
            fwd("bf16", 128, packed, True, paged=True),
            fwd("fp32", 64, dense, False, paged=True),
            fwd("bf16", 64, causal, True, "i64", paged=True),
            fwd("fp16", 64, causal, True, rows=3, paged=True),
            fwd("bf16", 256, causal, False, rows=8, paged=True),
        ]
    )
    return specs


AOT_SPECS: Dict[str, List[dict]] = _aot_specs()
