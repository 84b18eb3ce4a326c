"""Runs vLLM on a list of prompts, with and without the specdec_kernels plugin; prints JSON.

Run by the Python of a virtual environment that has vLLM (``scripts/setup_vllm_env.sh``
makes one), never imported by the main package: ``specdec_kernels.bench.vllm`` and ``tests/integrations/test_vllm_plugin.py``
start it as a subprocess.  One engine serves every run of the spec, so its start-up (about a
minute on a small CPU) is paid once.

    python -I specdec_kernels/bench/vllm_driver.py SPEC.json OUT.json

(-I keeps bench/ off the path: its kernels.py would shadow a package of that name that
transformers looks for; vLLM's processes then import the specdec_kernels installed in that
environment.)

SPEC (JSON): ``model`` (a transformers folder), ``prompts`` (list of str, or of lists of
token ids), ``method`` ("ngram" or "none"), ``num_speculative_tokens``, ``tensor_parallel_size``,
``plugin`` ("toggle": the engine runs in this process and the plugin is switched per run with
``install``/``uninstall``; "env": the plugin is whatever ``SPECDEC_VLLM`` says, in every vLLM
process), ``runs``: a list of ``{"name", "plugin": bool, "prompts" (this run's, else the spec's), "temperature" (or "temperatures", one per prompt), "top_k", "top_p",
"allowed_token_ids", "seeds" (one per prompt, or null), "max_tokens", "ignore_eos" (default
true), "repeat", "batch1" (one prompt per ``generate`` call)}``.

OUT (JSON): the spec's runs, each with ``tokens`` (per prompt, the generated ids), ``seconds``
(wall time of each ``generate`` call), ``generated`` (tokens), and vLLM's speculative
counters over that run (``drafts``, ``draft_tokens``, ``accepted_tokens``).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _counters(llm) -> dict:
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    out = {v: 0 for v in names.values()}
    for m in llm.get_metrics():
        if m.name in names and hasattr(m, "value"):
            out[names[m.name]] += int(m.value)
    return out


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    mode = spec.get("plugin", "toggle")
    if mode not in ("toggle", "env"):
        raise ValueError(f"plugin must be 'toggle' or 'env', got {mode!r}")
    tp = int(spec.get("tensor_parallel_size", 1))
    if mode == "toggle":
        if tp != 1:
            raise ValueError("plugin='toggle' runs the engine in this process: tensor_parallel_size must be 1")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from specdec_kernels.integrations import vllm as plugin

    method = spec.get("method", "ngram")
    speculative = None
    if method == "ngram":
        speculative = {
            "method": "ngram",
            "num_speculative_tokens": int(spec.get("num_speculative_tokens", 8)),
            "prompt_lookup_max": int(spec.get("prompt_lookup_max", 4)),
            "prompt_lookup_min": int(spec.get("prompt_lookup_min", 2)),
        }
    elif method != "none":
        raise ValueError(f"method must be 'ngram' or 'none', got {method!r}")
    kwargs = dict(
        dtype="float32",
        enforce_eager=True,
        max_model_len=int(spec.get("max_model_len", 2048)),
        speculative_config=speculative,
        seed=0,
        gpu_memory_utilization=float(spec.get("memory", 0.1)),
        disable_log_stats=False,
        tensor_parallel_size=tp,
        pipeline_parallel_size=int(spec.get("pipeline_parallel_size", 1)),
    )
    if mode == "toggle":
        kwargs["distributed_executor_backend"] = "uni"
    llm = LLM(spec["model"], **kwargs)
    as_prompts = lambda ps: [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in ps]  # noqa: E731
    results = []
    for run in spec["runs"]:
        prompts = as_prompts(run.get("prompts") or spec["prompts"])
        if mode == "toggle":
            plugin.install() if run.get("plugin") else plugin.uninstall()
        seeds = run.get("seeds")
        temps = run.get("temperatures") or [run.get("temperature", 0.0)] * len(prompts)
        params = [
            SamplingParams(
                temperature=float(temps[i]),
                top_k=int(run.get("top_k", 0)),
                top_p=float(run.get("top_p", 1.0)),
                seed=None if seeds is None else int(seeds[i]),
                max_tokens=int(run["max_tokens"]),
                ignore_eos=bool(run.get("ignore_eos", True)),
                allowed_token_ids=run.get("allowed_token_ids"),
            )
            for i in range(len(prompts))
        ]
        before = _counters(llm)
        seconds, outs = [], None
        for _ in range(int(run.get("repeat", 1))):
            if run.get("batch1"):  # one prompt at a time
                outs = []
                for p, sp in zip(prompts, params):
                    t = time.perf_counter()
                    outs += llm.generate([p], [sp], use_tqdm=False)
                    seconds.append(time.perf_counter() - t)
            else:
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds.append(time.perf_counter() - t)
        after = _counters(llm)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        results.append(
            {
                **{k: v for k, v in run.items() if k != "prompts"},
                "tokens": tokens,
                "seconds": seconds,
                "generated": sum(len(t) for t in tokens),
                "plugin_installed": plugin.installed() if mode == "toggle" else None,
                **{k: after[k] - before[k] for k in after},
            }
        )
    with open(out_path, "w") as f:
        json.dump({"spec": spec, "runs": results, "vllm": __import__("vllm").__version__}, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -I specdec_kernels/bench/vllm_driver.py SPEC.json OUT.json")
    main(sys.argv[1], sys.argv[2])
