"""Runs the user's training script or module as ``__main__``, in whichever process becomes the
worker: the worker's own process (:mod:`flashckpt.elastic.launch.worker_entry`) or a fork of the
pre-warmed zygote (:mod:`flashckpt.elastic.launch.prewarm`). Below both, so that neither imports the
other for it.

A worker that fails with an exception prints its traceback, flushes its output and logging, and
exits at once with code 1, without the interpreter's teardown (see
:mod:`flashckpt.elastic.launch.worker_entry`); ``FLASHCKPT_WORKER_FAST_EXIT=0`` keeps the normal
teardown.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import traceback

from flashckpt import envnames
from flashckpt.elastic.launch import storewait, workererrors

__all__ = ["FAST_EXIT_ENV", "run_user_code"]

FAST_EXIT_ENV = envnames.WORKER_FAST_EXIT
"""``0`` disables the immediate exit of a worker that failed with an exception."""


def run_user_code(args: list[str]) -> None:
    """Runs ``[script, *args]`` or ``["-m", module, *args]`` as ``__main__``.

    A failure with an exception ends the process at once (see the module docstring). Its
    c10d store clients connect as soon as the round's store listens
    (:mod:`flashckpt.elastic.launch.storewait`).
    """
    storewait.install()
    try:
        if args[0] == "-m":
            module = args[1]
            sys.argv = [module, *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script = args[0]
            sys.argv = [script, *args[1:]]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        # An error no restart can mend (the configuration's, the machine's) goes to the
        # launcher too, which then fails at once with it instead of restarting the workers.
        workererrors.record(exc)
        if os.environ.get(FAST_EXIT_ENV, "1") == "0":
            raise
        _exit_now()


def _exit_now() -> None:
    """Reports the exception in flight like the interpreter would, then exits with code 1."""
    try:
        traceback.print_exc()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(1)
