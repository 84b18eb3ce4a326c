"""What ``bench.e2e`` reports of its rows: the summary lines, the tables and the plot.

Measures nothing itself: from the per-prompt rows of the harness (``e2e.py``) it makes the
summary lines (per method, overall then per category, means over prompts: tokens/s, decode
rate, time to first token, tokens per CPU-second, accepted length, mean K, speed-ups against
our greedy, transformers' greedy and llama.cpp's greedy, token identity), prints them as
aligned tables and draws ``e2e.png``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List, Optional

from specdec_kernels.bench.common import METHOD, TOKENS_PER_S, column, format_table, pyplot_or_none, save_figure
from specdec_kernels.bench.e2e_methods import Method


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarise(rows: List[Dict], methods: List[Method]) -> List[Dict]:
    """Summary lines: per method, overall then per category (means over prompts)."""
    categories = list(dict.fromkeys(r["category"] for r in rows))
    out = []
    for scope in ["overall"] + categories:
        mine = [r for r in rows if scope == "overall" or r["category"] == scope]
        speed = {m.name: _mean([r["tokens_per_s"] for r in mine if r["method"] == m.name]) for m in methods}
        decode = {m.name: _mean([r.get("decode_tokens_per_s") for r in mine if r["method"] == m.name]) for m in methods}
        for m in methods:
            rs = [r for r in mine if r["method"] == m.name]
            same = sum(r["same_tokens"] for r in rs)
            out.append(
                {
                    "kind": "summary",
                    "scope": scope,
                    "method": m.name,
                    "family": m.family,
                    "description": m.description,
                    "params": m.params,
                    "prompts": len(rs),
                    "new_tokens": sum(r["new_tokens"] for r in rs),
                    "seconds": sum(r["seconds"] for r in rs),
                    "tokens_per_s": speed[m.name],
                    "ttft_s": _mean([r.get("ttft_s") for r in rs]),
                    "decode_tokens_per_s": _mean([r.get("decode_tokens_per_s") for r in rs]),
                    "tokens_per_cpu_s": _mean([r.get("tokens_per_cpu_s") for r in rs]),
                    "decode_tokens_per_cpu_s": _mean([r.get("decode_tokens_per_cpu_s") for r in rs]),
                    "mean_accepted_length": _mean([r["mean_accepted_length"] for r in rs]),
                    "mean_draft_length": _mean([r.get("mean_draft_length") for r in rs]),
                    "speedup_vs_greedy": _ratio(speed[m.name], speed.get("greedy")),
                    "speedup_vs_hf_greedy": _ratio(speed[m.name], speed.get("hf-greedy")),
                    "speedup_vs_llamacpp_greedy": _ratio(speed[m.name], speed.get("llamacpp-greedy")),
                    "decode_speedup_vs_llamacpp_greedy": _ratio(decode[m.name], decode.get("llamacpp-greedy")),
                    "same_tokens": same == len(rs),
                    "same_tokens_count": f"{same}/{len(rs)}",
                    "same_as_llamacpp_greedy_count": (
                        f"{sum(bool(r.get('same_as_llamacpp_greedy')) for r in rs)}/{len(rs)}"
                        if rs and all(r.get("same_as_llamacpp_greedy") is not None for r in rs)
                        else None
                    ),
                }
            )
    return out


def print_tables(
    summary: List[Dict], env: Dict, n_prompts: int, max_new_tokens: int, skipped: Optional[Dict[str, str]] = None
) -> None:
    """The overall table (one line per method) and, per category, tokens/s, accepted length and
    speed-up over our greedy, on stdout; the llama.cpp columns only when llama.cpp's greedy ran."""
    overall = [s for s in summary if s["scope"] == "overall"]
    for s in overall:
        s["same_str"] = s["same_tokens_count"] + ("" if s["same_tokens"] else "  MISMATCH")
        s["ttft_ms"] = None if s.get("ttft_s") is None else 1e3 * s["ttft_s"]
    # the llama.cpp columns only when llama.cpp's greedy ran
    llamacpp = [
        column("speedup_vs_llamacpp_greedy", "e2e x llama.cpp", "{:.2f}"),
        column("decode_speedup_vs_llamacpp_greedy", "decode x llama.cpp", "{:.2f}"),
        column("same_as_llamacpp_greedy_count", "same as llama.cpp"),
    ]
    if not any(s.get("speedup_vs_llamacpp_greedy") is not None for s in overall):
        llamacpp = []
    print(
        f"# bench.e2e: SmolLM2-135M-Instruct, {env['dtype']}, {env['device']}, torch {env['torch']}, commit "
        f"{env['commit']}; {n_prompts} Spec-Bench prompts, batch 1, greedy, <= {max_new_tokens} new tokens"
    )
    if env.get("uncommitted"):
        print(f"# measured on a working tree with uncommitted changes in: {', '.join(env['uncommitted'])}")
    print(
        "# overall (means over prompts; speed-up = ratio of mean tokens/s; decode = after the first token; "
        "tok/CPU-s = new tokens per CPU-second of the decoding process)"
    )
    print(
        format_table(
            overall,
            [
                METHOD,
                column("family"),
                column("description", "settings"),
                TOKENS_PER_S,
                column("decode_tokens_per_s", "decode tok/s", "{:.1f}"),
                column("ttft_ms", "TTFT ms", "{:.0f}"),
                column("tokens_per_cpu_s", "tok/CPU-s", "{:.1f}"),
                column("decode_tokens_per_cpu_s", "decode tok/CPU-s", "{:.1f}"),
                column("mean_accepted_length", "accepted len", "{:.2f}"),
                column("mean_draft_length", "mean K", "{:.2f}"),
                column("speedup_vs_greedy", "x greedy", "{:.2f}"),
                column("speedup_vs_hf_greedy", "x hf-greedy", "{:.2f}"),
            ]
            + llamacpp
            + [column("same_str", "same tokens")],
        )
    )
    for name, reason in (skipped or {}).items():
        print(f"# skipped {name}: {reason}")
    methods = [s["method"] for s in overall]
    categories = list(dict.fromkeys(s["scope"] for s in summary if s["scope"] != "overall"))
    for title, key, fmt in [
        TOKENS_PER_S,
        column("mean_accepted_length", "mean accepted length", "{:.2f}"),
        column("speedup_vs_greedy", "speed-up vs our greedy", "{:.2f}"),
    ]:
        table = []
        for c in categories + ["overall"]:
            row = {"category": c}
            for s in summary:
                if s["scope"] == c:
                    row[s["method"]] = s[key]
            table.append(row)
        print(f"# {title} by category")
        print(format_table(table, [column("category")] + [column(m, fmt=fmt) for m in methods]))
    if any(not s["same_tokens"] for s in summary):
        print("# same tokens: see the overall table; per prompt in e2e.jsonl (first_mismatch)")


def plot(summary: List[Dict], path: Path, env: Dict, max_new_tokens: int) -> None:
    """Tokens/s per method: overall (top, speed-up over our greedy and transformers' greedy
    written on the bars) and per category (bottom)."""
    plt = pyplot_or_none(path)
    if plt is None:
        return
    overall = [s for s in summary if s["scope"] == "overall"]
    methods = [s["method"] for s in overall]
    categories = list(dict.fromkeys(s["scope"] for s in summary if s["scope"] != "overall"))
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(8, 1.1 * len(categories) + 3), 8.5), gridspec_kw={"height_ratios": [1, 1.3]}
    )
    ys = [s["tokens_per_s"] or 0 for s in overall]
    bars = top.bar(
        range(len(methods)),
        ys,
        color=[colors[m] for m in methods],
        hatch=None,
        edgecolor=["k" if s["family"] == "ours" else "grey" for s in overall],
    )
    for b, s in zip(bars, overall):
        label = "" if s["speedup_vs_greedy"] is None else f"{s['speedup_vs_greedy']:.2f}x"
        if s["speedup_vs_hf_greedy"] is not None:
            label += f"\n{s['speedup_vs_hf_greedy']:.2f}x hf"
        if not s["same_tokens"]:
            label += "\nMISMATCH"
        top.text(b.get_x() + b.get_width() / 2, b.get_height(), label, ha="center", va="bottom", fontsize=7)
    top.set_xticks(range(len(methods)))
    top.set_xticklabels(methods, rotation=15, fontsize=8)
    top.set_ylabel("tokens/s")
    top.set_ylim(0, max(ys + [1]) * 1.3)
    top.set_title("overall (mean over prompts); labels: speed-up vs our greedy / vs transformers greedy", fontsize=9)
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [
            next((s["tokens_per_s"] or 0 for s in summary if s["scope"] == c and s["method"] == m), 0)
            for c in categories
        ]
        bottom.bar([i + j * width for i in range(len(categories))], vals, width, label=m, color=colors[m])
    bottom.set_xticks([i + 0.4 - width / 2 for i in range(len(categories))])
    bottom.set_xticklabels(categories, rotation=20, fontsize=8, ha="right")
    bottom.set_ylabel("tokens/s")
    bottom.set_title("per category", fontsize=9)
    bottom.legend(fontsize=7, ncol=min(5, len(methods)))
    save_figure(
        fig,
        path,
        f"SmolLM2-135M-Instruct, batch 1, greedy, <= {max_new_tokens} new tokens, {env['dtype']} on "
        f"{env['device']} (commit {env['commit']})",
    )
