"""llama.cpp's methods of ``bench.e2e``: llama-cpp-python on the GGUF our weights come from.

What they measure: llama.cpp's greedy decoding and its prompt lookup draft model
(``LlamaPromptLookupDecoding``, ``LLAMACPP_PROMPT_LOOKUP`` tokens), fed the same prompt token
ids as our engine, ``--threads`` threads, in the driver process of the llama.cpp environment
(``llamacpp.py``, ``llamacpp_driver.py``).  Timed in the driver: wall and CPU seconds of the
generation and of its first token; target passes are its ``eval`` calls, the prefill
included.  Without the environment the methods are reported as skipped, with the reason.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from specdec_kernels.bench.e2e_methods import Context, Method, Run, register

LLAMACPP_PROMPT_LOOKUP = (10, 2)  # num_pred_tokens: llama-cpp-python's default, and 2 (its best in issue 37)


def llamacpp_method(name: str, num_pred_tokens: int, description: str, *, default: bool = True, **params) -> Method:
    """A method of llama.cpp (llama-cpp-python) on the GGUF our weights come from, run by
    ``specdec_kernels/bench/llamacpp_driver.py`` in the llama.cpp environment (one process for the whole run,
    started at the first call and kept in ``ctx.cache``).

    The prompt's token ids go to llama.cpp as tokens; greedy (temperature 0, top-k 1, no repeat
    penalty), stopping after ``ctx.eos_token_id``, ``ctx.threads`` threads.  Timed in the
    driver: wall and CPU seconds (the driver process, all its threads) of the generation and of
    its first token.  Target passes are llama-cpp-python's ``eval`` calls, the prefill included
    (it emits the first token); the draft tokens are those fed to the passes after it, and the
    accepted ones are the tokens emitted beyond one per pass.

    Args:
        name: method name.
        num_pred_tokens: 0 for plain decoding; N > 0: ``LlamaPromptLookupDecoding(num_pred_tokens=N)``
            as the draft model (llama-cpp-python's prompt lookup, its ``max_ngram_size`` 2).
        description: one line for the table.
        default: run when --methods is not given.
        **params: settings written to the JSON lines.
    """

    def run(ctx: Context, prompt: List[int], max_new_tokens: int) -> Run:
        from specdec_kernels.bench import llamacpp

        driver = ctx.cache.get("llamacpp")
        if driver is None:
            driver = ctx.cache["llamacpp"] = llamacpp.Driver()
        r = driver.request(
            "generate",
            model=llamacpp.gguf_path(),
            prompt=list(prompt),
            max_new_tokens=max_new_tokens,
            eos=ctx.eos_token_id,
            threads=ctx.threads or torch.get_num_threads(),
            num_pred_tokens=num_pred_tokens,
        )
        tokens, passes = r["tokens"], r["pass_sizes"]
        extra = {
            "llama_cpp_python": driver.info["llama_cpp_python"],
            "use_extra_bufts": driver.info["use_extra_bufts"],
            "extra_bufts": driver.info["extra_bufts"],
        }
        return Run(
            tokens,
            r["seconds"],
            len(passes),
            len(tokens) / len(passes) if passes else None,
            sum(n - 1 for n in passes[1:]) if num_pred_tokens else None,
            len(tokens) - len(passes) if num_pred_tokens else None,
            extra,
            ttft_s=r["ttft_s"],
            cpu_seconds=r["cpu_seconds"],
            cpu_ttft_s=r["cpu_ttft_s"],
        )

    def unavailable() -> Optional[str]:
        from specdec_kernels.bench import llamacpp

        return llamacpp.unavailable()

    return Method(
        name, "llama.cpp", description, run, {"num_pred_tokens": num_pred_tokens, **params}, default, unavailable
    )


def register_builtin() -> None:
    """Register llama.cpp's methods in ``METHODS``."""
    # llama.cpp on the same GGUF: what a CPU user runs instead of us
    register(llamacpp_method("llamacpp-greedy", 0, "llama.cpp greedy (llama-cpp-python)"))
    for i, n in enumerate(LLAMACPP_PROMPT_LOOKUP):
        register(
            llamacpp_method(
                "llamacpp-prompt-lookup" + ("" if i == 0 else f"-{n}"),
                n,
                f"llama.cpp prompt lookup, {n} tokens",
                max_ngram_size=2,
            )
        )
