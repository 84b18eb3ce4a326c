"""Runs llama.cpp (llama-cpp-python) for the benchmarks; JSON requests in, JSON answers out.

Run by the Python of the llama.cpp environment (``scripts/setup_llamacpp_env.sh`` makes one),
never imported by the main package: ``specdec_kernels.bench.llamacpp`` starts it as a subprocess and keeps it
for the whole benchmark, so that llama.cpp's runs interleave with ours and its model loads
once.  It imports nothing from this repository.

    python -I specdec_kernels/bench/llamacpp_driver.py

One JSON object per line on stdin, one answer per line on stdout (``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``); llama.cpp's own output goes to stderr.  Requests:

* ``{"op": "info"}``: the llama-cpp-python version, llama.cpp's system info, and whether the
  model parameters have ``use_extra_bufts``.
* ``{"op": "generate", "model", "prompt", "max_new_tokens", "eos", "threads",
  "num_pred_tokens"}``: one greedy generation (temperature 0, top-k 1, no repeat penalty) from
  the prompt's token ids (given as tokens: no text, no BOS added), stopping after ``eos`` (kept)
  or ``max_new_tokens`` tokens.  ``num_pred_tokens`` 0: plain decoding; N > 0: llama-cpp-python's
  ``LlamaPromptLookupDecoding(num_pred_tokens=N)`` as the draft model, verified by its own
  ``generate`` loop.  Answer: ``tokens``, ``seconds`` (wall time of the generation),
  ``ttft_s`` (to the first new token), ``cpu_seconds`` / ``cpu_ttft_s`` (this process's CPU
  time, all threads, over the same spans), ``pass_sizes`` (tokens fed to every target pass:
  ``Llama.eval`` calls, the prefill first).
* ``{"op": "pass_cost", "model", "threads", "prefix", "sizes", "tokens", "min_time"}``: the
  wall time of one target pass of N tokens (``Llama.eval``, logits for every row) after the
  ``prefix`` token ids are cached, for each N in ``sizes`` (``tokens`` supplies the ids);
  answer ``rows`` of ``N``, ``median_us``, ``p20_us``, ``p80_us``, ``reps``, and ``prefill_us``
  (the median of 3 passes over the prefix itself, from an empty cache).
* ``{"op": "quit"}``.

Weight buffers: ``$SPECDEC_LLAMACPP_EXTRA_BUFTS`` "on" loads every model with llama.cpp's
default extra weight buffers (``use_extra_bufts``: its repacked CPU weights, and AMX tiles on
CPUs that have them), "off" (the default when the variable is unset) without them.  The
caller (``bench.llamacpp.extra_bufts_choice``) decides by a probe in a process of its own:
llama.cpp's default is its fastest, but its AMX path segfaults on some Xeons on the first
forward (llama.cpp issue 20824).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

# llama.cpp's messages on fd 1 would break the protocol: answers go to a copy of stdout, and
# fd 1 (and so print) goes to stderr
_ANSWERS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

import llama_cpp  # noqa: E402  (after the redirect: loading the library may print)
import llama_cpp.llama_cpp as _lib  # noqa: E402
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: E402

_HAS_EXTRA_BUFTS = any(name == "use_extra_bufts" for name, _ in _lib.llama_model_params._fields_)
_EXTRA_BUFTS = os.environ.get("SPECDEC_LLAMACPP_EXTRA_BUFTS", "off") == "on"
_default_model_params = _lib.llama_model_default_params


def _model_params():
    params = _default_model_params()
    if _HAS_EXTRA_BUFTS:
        params.use_extra_bufts = _EXTRA_BUFTS
    return params


# Llama() takes its model parameters from this function and has no argument for the field
_lib.llama_model_default_params = _model_params

_MODELS = {}


def _llama(path: str, threads: int, logits_all: bool, n_ctx: int):
    """One Llama per (file, threads, logits for every row), kept; reloaded when a request needs
    a longer context.  Its ``eval`` is wrapped to record the size of every target pass."""
    key = (path, threads, logits_all)
    held = _MODELS.get(key)
    if held is not None and held.n_ctx() >= n_ctx:
        return held
    if held is not None:
        _MODELS.pop(key)
        held.close()
    size = 2048
    while size < n_ctx:
        size *= 2
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=size,
        n_batch=size,  # a prompt is one pass
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
    )
    passes = []
    plain_eval = llm.eval

    def eval_counted(tokens):
        passes.append(len(tokens))
        return plain_eval(tokens)

    llm.eval = eval_counted
    llm.pass_sizes = passes
    _MODELS[key] = llm
    return llm


def generate(req: dict) -> dict:
    prompt = [int(t) for t in req["prompt"]]
    max_new, eos = int(req["max_new_tokens"]), int(req["eos"])
    k = int(req.get("num_pred_tokens", 0))
    llm = _llama(req["model"], int(req["threads"]), k > 0, len(prompt) + max_new + k + 1)
    llm.draft_model = LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None
    llm.reset()  # no reuse of an earlier request's cache: every run computes its prompt
    llm.pass_sizes.clear()
    tokens = []
    ttft = cpu_ttft = None
    c0, t0 = time.process_time(), time.perf_counter()
    stream = llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0, repeat_penalty=1.0)
    for token in stream:
        if ttft is None:
            ttft, cpu_ttft = time.perf_counter() - t0, time.process_time() - c0
        tokens.append(int(token))
        if token == eos or len(tokens) >= max_new:
            break
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    stream.close()
    return {
        "tokens": tokens,
        "seconds": seconds,
        "ttft_s": ttft,
        "cpu_seconds": cpu,
        "cpu_ttft_s": cpu_ttft,
        "pass_sizes": list(llm.pass_sizes),
        "n_ctx": llm.n_ctx(),
        "llama_eos": int(llm.token_eos()),
    }


def pass_cost(req: dict) -> dict:
    prefix = [int(t) for t in req["prefix"]]
    sizes = [int(n) for n in req["sizes"]]
    ids = [int(t) for t in req["tokens"]]
    min_time = float(req.get("min_time", 0.5))
    llm = _llama(req["model"], int(req["threads"]), True, len(prefix) + max(sizes))
    prefill = []
    for _ in range(3):  # the prefix's own pass (prefill), timed: the median of 3
        llm.reset()
        t = time.perf_counter()
        llm.eval(prefix)
        prefill.append(time.perf_counter() - t)
    rows = []
    for n in sizes:
        block = ids[:n]
        times = []
        start = time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < 1000):
            llm.n_tokens = len(prefix)  # eval drops the cache past n_tokens: the same pass again
            t = time.perf_counter()
            llm.eval(block)
            times.append(time.perf_counter() - t)
        times = times[1:]  # the first pass of a new size sets up its buffers
        times.sort()
        pick = lambda q: times[min(len(times) - 1, int(q * (len(times) - 1) + 0.5))]  # noqa: E731
        rows.append(
            {
                "N": n,
                "median_us": statistics.median(times) * 1e6,
                "p20_us": pick(0.2) * 1e6,
                "p80_us": pick(0.8) * 1e6,
                "reps": len(times),
            }
        )
    llm.pass_sizes.clear()
    return {"rows": rows, "prefix": len(prefix), "prefill_us": statistics.median(prefill) * 1e6}


def info(req: dict) -> dict:
    import importlib.metadata

    return {
        "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "use_extra_bufts": _EXTRA_BUFTS if _HAS_EXTRA_BUFTS else None,
    }


OPS = {"info": info, "generate": generate, "pass_cost": pass_cost}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("op") == "quit":
                break
            answer = {"ok": True, **OPS[req["op"]](req)}
        except Exception as e:  # noqa: BLE001  (reported to the caller, which raises it)
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        _ANSWERS.write(json.dumps(answer) + "\n")
        _ANSWERS.flush()
    for llm in _MODELS.values():
        llm.close()


if __name__ == "__main__":
    main()
