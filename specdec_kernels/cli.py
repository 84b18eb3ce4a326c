"""Ctrl-C in the package's command-line tools: exit status 130 and one line, never a traceback.

A tool's ``main`` turns ``KeyboardInterrupt`` into status 130 and one line on stderr
(``generate.main`` itself, the others through ``run_main``, which their ``__main__`` blocks
call).  But ``python -m specdec_kernels.<tool>`` first imports the package (torch alone takes
a second or more), and a Ctrl-C then would end in a ``KeyboardInterrupt`` traceback from the
middle of an import, with return code -2.  So this module, the first thing the package's
``__init__`` imports, runs ``during_import``: when, and only when, Python is locating a
``-m`` module of this package (``sys.argv[0]`` is then ``"-m"`` and ``sys.orig_argv`` names
the module), it installs a SIGINT handler that writes ``(interrupted)`` and ends the process
at once with status 130 (``os._exit``: nothing has started that would need cleaning up).
The tool's ``main`` puts Python's own handler back (``restore``) inside its ``try``, from
where a Ctrl-C is an ordinary ``KeyboardInterrupt`` again.  Importing the package in any
other way changes no signal handler.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, NoReturn, Optional

PACKAGE = "specdec_kernels"
MESSAGE = "(interrupted)"
STATUS = 130  # 128 + SIGINT, what shells report for a process ended by Ctrl-C


def _exit_now(status: int, line: Optional[str] = None) -> NoReturn:
    """Write ``line`` (if any) to stderr, flush stdout and stderr, and end the process with
    ``status`` at once (``os._exit``: no atexit handlers, no interpreter shutdown)."""
    for stream, text in ((sys.stdout, None), (sys.stderr, line)):
        try:
            if text is not None:
                stream.write(text + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001  (a closed or broken stream: exit all the same)
            pass
    os._exit(status)


def _exit_interrupted(signum, frame) -> None:  # noqa: ARG001  (a signal handler's signature)
    """SIGINT before the tool's ``main`` runs: one line on stderr, status 130, at once."""
    _exit_now(STATUS, MESSAGE)


def _module_run_with_m() -> Optional[str]:
    """The module of ``python -m <module>`` while Python locates it (``sys.argv[0]`` is ``"-m"``
    only then), from ``sys.orig_argv``; None otherwise."""
    if sys.argv[:1] != ["-m"]:
        return None
    args = list(getattr(sys, "orig_argv", []))[1:]
    for i, arg in enumerate(args):
        if arg == "-m":
            return args[i + 1] if i + 1 < len(args) else None
        if arg.startswith("-m"):
            return arg[2:]
    return None


def during_import() -> bool:
    """Install the exit-130 SIGINT handler when Python is importing the package to run one of
    its modules with ``-m`` (and SIGINT still has Python's own handler); returns whether it
    did.  Runs when this module is first imported (by ``specdec_kernels/__init__.py``, before
    anything else); a second call finds the handler installed and changes nothing."""
    module = _module_run_with_m()
    if module is None or not (module == PACKAGE or module.startswith(PACKAGE + ".")):
        return False
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False  # someone chose another handler (or ignores SIGINT): keep it
        signal.signal(signal.SIGINT, _exit_interrupted)
    except ValueError:  # not the main thread
        return False
    return True


_interrupted = False  # a SIGINT reached _interrupt


def _interrupt(signum, frame) -> NoReturn:  # noqa: ARG001  (a signal handler's signature)
    """Python's own SIGINT behaviour (raise ``KeyboardInterrupt``), remembering that it came.
    CPython only reports, and so loses, an exception raised where it runs a callback it cannot
    propagate from (a weakref callback of the import machinery, a ``__del__``): ``run_main``
    then still exits 130 once ``main`` returns."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _unraisable(info) -> None:
    """``sys.unraisablehook`` while a tool runs: a lost ``KeyboardInterrupt`` is not reported
    (``run_main`` reports the interrupt in one line); anything else goes to Python's hook."""
    if isinstance(info.exc_value, KeyboardInterrupt):
        return
    sys.__unraisablehook__(info)


def restore() -> None:
    """Put Python's SIGINT behaviour (``KeyboardInterrupt``, through ``_interrupt``, which
    also remembers it) back where ``during_import`` installed its own handler; call it inside
    the ``try`` that catches ``KeyboardInterrupt``."""
    try:
        if signal.getsignal(signal.SIGINT) is _exit_interrupted:
            signal.signal(signal.SIGINT, _interrupt)
            sys.unraisablehook = _unraisable
    except ValueError:  # not the main thread, where no handler can be set
        pass


def run_main(main: Callable[[], Optional[int]]) -> NoReturn:
    """Run a tool's ``main()`` as its ``__main__`` block does, and exit with its status: 130
    and one line on stderr when Ctrl-C interrupts it, with no traceback; once ``main`` has
    returned, Ctrl-C is ignored (the run is over; only the interpreter's shutdown is left).

    Status 130 (the interrupt, caught here or by ``main``) ends the process with ``os._exit``
    once stdout and stderr are flushed: under ``python -m``, CPython (3.11 at least) turns a
    ``sys.exit`` into a death by SIGINT (return code -2) when the ``KeyboardInterrupt`` passed
    through a C extension's ``PyRun_*`` call on its way (a flag those calls set and only they
    reset).  By then the exception has unwound every ``finally`` and ``with`` block; only the
    atexit handlers are skipped.

    Args:
        main: the tool's entry point, returning its exit status (None: 0).
    """
    try:
        try:
            restore()
            status = main()
            if _interrupted and status != STATUS:  # an interrupt CPython lost (see _interrupt)
                print(MESSAGE, file=sys.stderr)
                status = STATUS
        except KeyboardInterrupt:
            print(MESSAGE, file=sys.stderr)
            status = STATUS
    finally:  # a usage error's SystemExit too
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if status == STATUS:
        _exit_now(STATUS)
    sys.exit(status)


during_import()  # the package imports this module first of all (``specdec_kernels/__init__.py``)
