"""`python -m specdec_kernels.bench.e2e --scenario shared-prefix`: batch decoding with a shared system prompt.

A batch of --batch requests (default 8) that share one long system prompt
(``specdec_kernels/bench/data/shared_system_prompt.txt``, about 600 tokens after the chat template) and ask
different Spec-Bench questions (the first turn of the first questions, one category after
another).  For each method (plain greedy, a layer-skip tree drafter, an n-gram tree) the
batch is decoded three ways over our engine, greedy, up to --max-new-tokens:

* ``alone``: every request on its own (batch 1, dense cache): the reference tokens;
* ``paged``: the whole batch at once over the paged KV cache, without sharing;
* ``shared``: the same with prefix sharing (``SpeculativeDecoder(block_size=16,
  share_prefix=True)``): the system prompt's K/V blocks are computed once and shared by
  every request (copy-on-write of the block where the questions begin).  The layer-skip
  drafter runs on the target's own cache (``DraftRun.target_kv_cache``): it feeds no
  prompt in either batched mode and holds no cache of its own.

Reported per run: prefill positions the target computed, prompt tokens taken from shared
blocks, positions fed through the draft model (prefill and drafting), KV-cache memory (the
pools, allocated once: also the peak), new tokens per second (all requests; wall time of the
generate call after a warm-up), and whether every request's tokens equal its ``alone``
tokens.  Writes a table, ``shared_prefix.jsonl`` and ``shared_prefix.png`` to --out; exits
with status 1 when a batched run does not reproduce the ``alone`` tokens.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

from specdec_kernels.bench.common import (
    METHOD,
    TOKENS_PER_S,
    JsonlWriter,
    column,
    format_table,
    pyplot_or_none,
    save_figure,
    write_jsonl,
)

SYSTEM_PROMPT_FILE = Path(__file__).resolve().parent / "data" / "shared_system_prompt.txt"
BLOCK_SIZE = 16
WARMUP_TOKENS = 8
SCENARIO_METHODS = ("greedy", "layerskip-tree", "ngram-tree")


def scenario_methods(ctx) -> Dict[str, Callable[[], Any]]:
    """name -> (drafter factory, K) of the methods this scenario runs."""
    from specdec_kernels.bench.e2e_ours import LAYERSKIP_LAYERS, LAYERSKIP_TREE
    from specdec_kernels.decoding import LayerSkipDrafter, NgramDrafter

    return {
        "greedy": (lambda: None, 0),
        "layerskip-tree": (lambda: LayerSkipDrafter(ctx.model, LAYERSKIP_LAYERS, tree_widths=LAYERSKIP_TREE), 4),
        "ngram-tree": (lambda: NgramDrafter(tree=True), 6),
    }


def shared_prefix_prompts(tokenizer, questions: List[Dict], batch: int, system_prompt: str) -> List[List[int]]:
    """``batch`` chat prompts: the same system message, the first turn of a different question each."""
    out = []
    for q in questions[:batch]:
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": q["turns"][0]}]
        out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    return out


def _timed(decoder, prompts, max_new_tokens, k, device):
    from specdec_kernels.bench.e2e_methods import _sync

    _sync(device)
    t = time.perf_counter()
    result = decoder.generate(prompts, max_new_tokens, num_draft_tokens=k)
    _sync(device)
    return result, time.perf_counter() - t


def run(args, ctx, questions, env) -> int:
    """Run the scenario on a loaded ``specdec_kernels.bench.e2e_methods.Context``; returns the exit status."""
    from specdec_kernels.bench.e2e import first_mismatch
    from specdec_kernels.decoding import SpeculativeDecoder
    from specdec_kernels.decoding.paged import common_prefix_length

    system_prompt = SYSTEM_PROMPT_FILE.read_text().strip()
    prompts = shared_prefix_prompts(ctx.tokenizer, questions, args.batch, system_prompt)
    common = min(common_prefix_length(prompts[0], p) for p in prompts[1:]) if len(prompts) > 1 else 0
    methods = scenario_methods(ctx)
    names = [m for m in args.methods.split(",") if m] if args.methods else list(SCENARIO_METHODS)
    print(
        f"# shared-prefix scenario: {len(prompts)} requests, prompts of {min(map(len, prompts))}..{max(map(len, prompts))} "
        f"tokens sharing their first {common}; block size {BLOCK_SIZE}; <= {args.max_new_tokens} new tokens, greedy",
        file=sys.stderr,
    )
    writer = JsonlWriter(Path(args.out_path) / "shared_prefix.jsonl", env)
    config = {
        "kind": "config",
        "scenario": "shared-prefix",
        "batch": len(prompts),
        "common_prefix_tokens": common,
        "prompt_tokens": [len(p) for p in prompts],
        "block_size": BLOCK_SIZE,
        "max_new_tokens": args.max_new_tokens,
        "methods": names,
        "model": "SmolLM2-135M-Instruct",
    }
    writer.write(config)
    rows = []
    failed = False
    for name in names:
        make, k = methods[name]
        decoders = {
            "alone": SpeculativeDecoder(ctx.model, make(), stop_token_ids=[ctx.eos_token_id]),
            "paged": SpeculativeDecoder(ctx.model, make(), stop_token_ids=[ctx.eos_token_id], block_size=BLOCK_SIZE),
            "shared": SpeculativeDecoder(
                ctx.model, make(), stop_token_ids=[ctx.eos_token_id], block_size=BLOCK_SIZE, share_prefix=True
            ),
        }
        for mode, dec in decoders.items():  # warm-up (allocator, lazy initialisation)
            dec.generate(prompts[:1] if mode == "alone" else prompts[:2], WARMUP_TOKENS, num_draft_tokens=k)
        alone_tokens, alone_s, alone_stats = [], 0.0, []
        for p in prompts:
            result, s = _timed(decoders["alone"], [p], args.max_new_tokens, k, ctx.device)
            alone_tokens.append(result.tokens[0])
            alone_s += s
            alone_stats.append(result.stats)
        runs = {
            "alone": (
                alone_tokens,
                alone_s,
                {
                    "prefill_tokens": sum(st.prefill_tokens for st in alone_stats),
                    "shared_prefill_tokens": 0,
                    "draft_model_tokens": sum(st.draft_model_tokens for st in alone_stats),
                    "kv_cache_bytes": max(st.kv_cache_bytes for st in alone_stats),
                },
            )
        }
        for mode in ("paged", "shared"):
            result, s = _timed(decoders[mode], prompts, args.max_new_tokens, k, ctx.device)
            st = result.stats
            runs[mode] = (
                result.tokens,
                s,
                {
                    "prefill_tokens": st.prefill_tokens,
                    "shared_prefill_tokens": st.shared_prefill_tokens,
                    "draft_model_tokens": st.draft_model_tokens,
                    "kv_cache_bytes": st.kv_cache_bytes,
                },
            )
        for mode, (tokens, seconds, counts) in runs.items():
            same = [first_mismatch(t, a) is None for t, a in zip(tokens, alone_tokens)]
            new = sum(len(t) for t in tokens)
            row = {
                "kind": "run",
                "method": name,
                "mode": mode,
                "batch": 1 if mode == "alone" else len(prompts),
                "new_tokens": new,
                "seconds": seconds,
                "tokens_per_s": new / seconds if seconds > 0 else None,
                **counts,
                "kv_cache_mib": counts["kv_cache_bytes"] / 2**20,
                "same_as_alone": all(same),
                "same_count": f"{sum(same)}/{len(same)}",
            }
            rows.append(row)
            writer.write(row)
            if not all(same):
                failed = True
    writer.close()
    from specdec_kernels.ops.tree_attention import automatic_cpu_path

    config["paged_attention_cpu_path"] = automatic_cpu_path(paged=True)  # fixed: "native" unless forced
    print(f"# paged attention on CPU: {config['paged_attention_cpu_path']}", file=sys.stderr)
    for r in rows:  # ratios against the unshared paged batch of the same method
        base = next(x for x in rows if x["method"] == r["method"] and x["mode"] == "paged")
        r["prefill_vs_paged"] = r["prefill_tokens"] / base["prefill_tokens"] if base["prefill_tokens"] else None
        r["draft_vs_paged"] = (
            r["draft_model_tokens"] / base["draft_model_tokens"] if base["draft_model_tokens"] else None
        )
        r["speed_vs_paged"] = (r["tokens_per_s"] or 0) / base["tokens_per_s"] if base["tokens_per_s"] else None
    out = Path(args.out_path)
    write_jsonl(out / "shared_prefix.jsonl", [config] + rows, env)
    print(
        f"# shared-prefix batch: SmolLM2-135M-Instruct, {env['dtype']}, {env['device']}, torch {env['torch']}, commit "
        f"{env['commit']}; {len(prompts)} requests sharing a {common}-token prefix; <= {args.max_new_tokens} new tokens"
    )
    print(
        format_table(
            rows,
            [
                METHOD,
                column("mode"),
                column("batch"),
                column("prefill_tokens", "prefill pos"),
                column("prefill_vs_paged", "x paged", "{:.2f}"),
                column("shared_prefill_tokens", "shared tok"),
                column("draft_model_tokens", "draft pos"),
                column("draft_vs_paged", "x paged", "{:.2f}"),
                column("kv_cache_mib", "KV MiB", "{:.1f}"),
                TOKENS_PER_S,
                column("speed_vs_paged", "x paged", "{:.2f}"),
                column("same_count", "same as alone"),
            ],
        )
    )
    plot(rows, out / "shared_prefix.png", env, len(prompts), common)
    print(f"# wrote {out / 'shared_prefix.jsonl'} and {out / 'shared_prefix.png'}")
    if failed:
        print("# MISMATCH: a batched run did not reproduce decoding each request alone", file=sys.stderr)
        return 1
    return 0


def plot(rows: List[Dict], path: Path, env: Dict, batch: int, common: int) -> None:
    """Three panels per method and mode: tokens/s, prefill positions, KV-cache MiB."""
    plt = pyplot_or_none(path)
    if plt is None:
        return
    methods = list(dict.fromkeys(r["method"] for r in rows))
    modes = ["alone", "paged", "shared"]
    colors = {"alone": "tab:gray", "paged": "tab:blue", "shared": "tab:green"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    width = 0.8 / len(modes)
    for ax, key, title in zip(
        axes,
        ["tokens_per_s", "prefill_tokens", "kv_cache_mib"],
        ["new tokens/s (all requests)", "target prefill positions computed", "KV cache MiB (peak)"],
    ):
        for j, mode in enumerate(modes):
            vals = [next((r[key] or 0 for r in rows if r["method"] == m and r["mode"] == mode), 0) for m in methods]
            ax.bar([i + j * width for i in range(len(methods))], vals, width, label=mode, color=colors[mode])
        ax.set_xticks([i + width for i in range(len(methods))])
        ax.set_xticklabels(methods, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    save_figure(
        fig,
        path,
        f"{batch} requests sharing a {common}-token system prompt, SmolLM2-135M-Instruct, {env['dtype']} on "
        f"{env['device']} (commit {env['commit']})",
    )
