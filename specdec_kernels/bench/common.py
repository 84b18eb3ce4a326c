"""Timing, environment capture and output (table, JSON lines, PNG) shared by the benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from specdec_kernels.decoding.model import ModelArgs

# The target models whose shapes the benchmarks use (their transformers configs; the
# positional fields: vocab, hidden, layers, heads, KV heads, head dim, MLP width).
MODEL_SHAPES: Dict[str, ModelArgs] = {
    "smollm2-135m": ModelArgs(49152, 576, 30, 9, 3, 64, 1536, rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-8b": ModelArgs(128256, 4096, 32, 32, 8, 128, 14336, rope_theta=500000.0),
    "qwen2.5-7b": ModelArgs(152064, 3584, 28, 28, 4, 128, 18944, rope_theta=1000000.0, qkv_bias=True),
}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's "model name" on Linux; else the platform's), and its
    core count, e.g. "AMD EPYC, 2 cores"."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "CPU"
    return f"{name}, {os.cpu_count()} cores"


def cpu_features() -> str:
    """The vector instruction sets the CPU reports that our kernels and llama.cpp's care about."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return ""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8", "amx_tile")
    return " ".join(w for w in wanted if w in flags)


def environment() -> Dict[str, str]:
    """Device, library versions, git commit and time: stamped on every JSON line."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        n = torch.get_num_threads()
        device = f"{cpu_model()} ({n} thread{'' if n == 1 else 's'})"
    return {
        "device": device,
        "cpu_features": cpu_features(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": commit or "unknown",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def chat_prompt_ids(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    """Token ids of each text as one user turn through the tokenizer's chat template, with the
    generation prompt (what every benchmark feeds every engine)."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
        for t in texts
    ]


def time_fn(fn: Callable[[], object], device: torch.device, min_run_time: float = 0.2) -> Dict[str, float]:
    """Median and 20th/80th percentiles of one call, in microseconds.

    GPU: ``triton.testing.do_bench`` (it flushes the L2 cache between calls).  CPU:
    ``torch.utils.benchmark.Timer.adaptive_autorange``.
    """
    if device.type == "cuda":
        import triton.testing

        median, p20, p80 = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=100)
        return {"median_us": median * 1e3, "p20_us": p20 * 1e3, "p80_us": p80 * 1e3}
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    m = timer.adaptive_autorange(threshold=0.1, min_run_time=min_run_time, max_run_time=max(2.0, 5 * min_run_time))
    times = sorted(m.times)
    pick = lambda q: times[min(len(times) - 1, int(q * (len(times) - 1) + 0.5))]  # noqa: E731
    return {"median_us": m.median * 1e6, "p20_us": pick(0.2) * 1e6, "p80_us": pick(0.8) * 1e6}


def time_graph_replay(fn: Callable[[], object], device: torch.device) -> Optional[Dict[str, float]]:
    """Median and 20th/80th percentiles, in microseconds, of one call of ``fn`` replayed from a
    CUDA graph (``triton.testing.do_bench_cudagraph``: many calls in one graph, no L2 flush
    between them): the GPU time of its kernels without the host's per-call work (Python checks,
    dispatch, Triton's launcher), which ``time_fn`` measures as well when a call's kernels are
    shorter than its host work.  None off CUDA, and where ``fn`` cannot be captured (a path
    that reads tensor values on the host, such as the references)."""
    if device.type != "cuda":
        return None
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles and allocator warm-up outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001  (capture refuses host reads with several error types)
        torch.cuda.synchronize()
        return None
    del graph  # the capture above only proves ``fn`` capturable; the timing captures its own
    # do_bench_cudagraph: many calls of ``fn`` in one graph, replayed, without do_bench's L2
    # flush before each call (a flushed L2 overstates decode-sized kernels, whose inputs a
    # decode loop has just written and still holds in L2)
    # rep 25 ms: a 5 us kernel gives 5000 calls in the graph, captured in about a second
    median, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=25, quantiles=[0.5, 0.2, 0.8])
    return {"median_us": median * 1e3, "p20_us": p20 * 1e3, "p80_us": p80 * 1e3}


def copy_bandwidth_gbps(device: torch.device, nbytes: Optional[int] = None) -> float:
    """Achieved copy bandwidth of ``device`` (bytes read + bytes written per second, GB/s),
    measured now with one large ``copy_`` (1 GiB on CUDA, 256 MiB on CPU, beyond the caches):
    the roofline the kernel benchmarks compare each op's ideal time against."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 28)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, 0.2)
    return 2 * nbytes / (t["median_us"] * 1e-6) / 1e9


Column = Tuple[str, str, str]  # (header, key, format): one column of ``format_table``


def column(key: str, header: Optional[str] = None, fmt: str = "{}") -> Column:
    """The ``format_table`` column of the rows' ``key``, each value formatted with ``fmt``
    (``str.format``), under ``header`` (default: the key itself)."""
    return (header or key, key, fmt)


# columns that several benchmarks print
METHOD = column("method")
DTYPE = column("dtype")
TOKENS_PER_S = column("tokens_per_s", "tokens/s", "{:.1f}")
TIME_US = [column(f"{q}_us", f"{q} us", "{:.1f}") for q in ("median", "p20", "p80")]  # time_fn's figures


def format_table(rows: Sequence[Dict], columns: Sequence[Column]) -> str:
    """An aligned text table; ``columns`` are (header, key, format) triples (see ``column``)."""
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        cells.append([("" if r.get(k) is None else f.format(r[k])) for _, k, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_jsonl(path: Path, rows: List[Dict], env: Dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({**env, **r}) + "\n")


def out_dir(arg: str | None, default: str) -> Path:
    """The output folder (``arg``, else $SPECDEC_BENCH_OUT, else ``default``), created and
    checked writable before any work.

    Raises:
        ValueError: the folder cannot be created or written (the message names it).
    """
    import tempfile

    path = Path(arg or os.environ.get("SPECDEC_BENCH_OUT", default))
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"--out {str(path)!r} is not a writable folder ({e.strerror or e})") from None
    return path


class JsonlWriter:
    """JSON lines written as they come (flushed each), so an interrupted run keeps its rows."""

    def __init__(self, path: Path, env: Dict[str, str]):
        self.path, self.env = path, env
        self._f = open(path, "w")

    def write(self, row: Dict) -> None:
        self._f.write(json.dumps({**self.env, **row}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def uncommitted_changes(paths: Sequence[str] = ("specdec_kernels", "bench")) -> List[str]:
    """Tracked files under ``paths`` (relative to the repository root) that differ from the
    commit ``environment()`` records, so that a result measured on a modified tree says so
    (none outside a git checkout)."""
    from specdec_kernels.bench import checkout_root

    root = checkout_root()
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *paths],
            capture_output=True,
            text=True,
            cwd=root,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in out.splitlines() if line.strip()]


def pyplot_or_none(path):
    """matplotlib's pyplot (Agg backend) for writing the plot ``path``, or None, with a note on
    stderr, where matplotlib is not installed (the GPU machine, whose wheels must fit in 64 MiB,
    gets none: scripts/fetch_gpu_wheels.sh); the tables and JSON lines are written either way."""
    try:
        import matplotlib
    except ImportError:
        print(
            f"# matplotlib is not installed (pip install matplotlib, or the extra: pip install "
            f"'specdec-kernels[bench]'): no plot {path}",
            file=sys.stderr,
        )
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, title: Optional[str] = None) -> None:
    """Write a matplotlib figure to ``path`` (PNG, 110 dpi) and close it: laid out tight, under
    ``title`` (the figure's own title, font size 9; None: none)."""
    import matplotlib.pyplot as plt

    if title is not None:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- flag checks of the benchmark CLIs
# Each takes the argparse parser and ends the run with its one-line error (exit status 2) naming
# the flag, so that a bad value is refused before any model loads or any timing starts.


def check_range(p, flag: str, value, low, high=None) -> None:
    """``value`` (an int or float flag; None: not given) lies in [low, high] (no upper bound
    when ``high`` is None); NaN never does."""
    if value is None:
        return
    if not (value >= low and (high is None or value <= high)):  # NaN fails both
        p.error(
            f"{flag} must lie in {low}..{high}, got {value}"
            if high is not None
            else f"{flag} must be >= {low}, got {value}"
        )


def int_list(p, flag: str, text: str, low: int = 1, high: Optional[int] = None) -> List[int]:
    """A comma-separated list of integers in [low, high] (at least one)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{flag} must be comma-separated integers, got {text!r}")
    if not values:
        p.error(f"{flag} must name at least one integer, got {text!r}")
    for v in values:
        check_range(p, flag, v, low, high)
    return values


def spec_bench_ids(p, flag: str, text: str) -> List[int]:
    """A comma-separated list of the packaged Spec-Bench question ids."""
    from specdec_kernels.decoding.prompts import spec_bench_questions

    known = {q["question_id"] for q in spec_bench_questions()}
    ids = int_list(p, flag, text, min(known), max(known))
    missing = [i for i in ids if i not in known]
    if missing:
        p.error(f"{flag}: no Spec-Bench question {missing[0]}")
    return ids


def check_device(p, flag: str, name: Optional[str]) -> None:
    """``name`` (None: automatic) is a device this torch can use."""
    if name == "cuda" and not torch.cuda.is_available():
        p.error(f"{flag} cuda: this torch sees no CUDA device")


def check_output_file(p, flag: str, path: Optional[str]) -> None:
    """``path`` (None: not given) can be written: not a folder, in an existing writable folder."""
    if path is None:
        return
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        p.error(f"{flag} {path!r} is a folder, not a file")
    if not folder.is_dir():
        p.error(f"{flag} {path!r}: no folder {str(folder)!r}")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        p.error(f"{flag} {path!r} cannot be written")


def model_positions() -> Optional[int]:
    """SmolLM2-135M-Instruct's positions from its config (no weights loaded), or None where the
    model package is missing (the benchmark then says so itself)."""
    from specdec_kernels.decoding.loading import have_smollm2, smollm2_config

    return smollm2_config()["max_position_embeddings"] if have_smollm2() else None


def too_long(prompts: Sequence[Sequence[int]], max_new_tokens: int, flag: str = "--max-new-tokens") -> Optional[str]:
    """The error line when the longest prompt plus ``max_new_tokens`` exceeds the model's
    positions, else None."""
    positions = model_positions()
    longest = max((len(x) for x in prompts), default=0)
    if positions is not None and longest + max_new_tokens > positions:
        return (
            f"{flag} {max_new_tokens} plus the longest prompt's {longest} tokens exceed the model's {positions} "
            f"positions (at most {max(positions - longest, 0)} new tokens)"
        )
    return None


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the benchmark CLIs, whose errors are one line ("prog: error: ...", exit
    status 2) like the engine's CLI, rather than the usage text then the error."""

    def error(self, message):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message}\n")
