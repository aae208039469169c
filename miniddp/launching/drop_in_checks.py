"""The drop-in runner's checks, made before the script runs: its two trace variables, and what it was asked to run.

What
    ``trace_steps()`` reads ``MINIDDP_TRACE_STEPS`` (a whole number >= 1, default 20) or raises ``ValueError``
    naming the variable. ``trace_folder_error(folder)`` says why ``MINIDDP_TRACE`` cannot hold the traces (a
    file, a path under a file, a place this process cannot write), else None; it creates the folder, as the
    runner would at the end. ``module_error(name)`` and ``path_error(path)`` say why ``python -m name`` or
    ``python PATH`` would not start (no such module, a package or a folder without ``__main__``), with the
    exit status Python gives, else None.

Why
    A trace folder found unwritable after training turns a finished job into a traceback and exit status 1,
    and leaves its process group undestroyed; found before the script, it is one line and exit status 2 (a
    bad flag's), and nothing has run. A missing module is one line in Python; the runner says it in one line
    too, not with runpy's traceback.

How Python differs
    ``python -m name`` makes the same check (``runpy._get_module_details``, used here) and prints
    ``No module named name``, exit status 1; ``python DIR`` runs ``DIR/__main__.py`` (``runpy.run_path``).
    torch has no such runner.
"""

from __future__ import annotations

import os
import pkgutil
import runpy
import tempfile

TRACE_ENV, TRACE_STEPS_ENV = "MINIDDP_TRACE", "MINIDDP_TRACE_STEPS"
DEFAULT_TRACE_STEPS = 20


def trace_steps(environ=None) -> int:
    """How many synced backwards a wrapper traces: ``MINIDDP_TRACE_STEPS``, default 20."""
    text = (os.environ if environ is None else environ).get(TRACE_STEPS_ENV, "").strip()
    if not text:
        return DEFAULT_TRACE_STEPS
    # ASCII digits only: int() also reads '+5', '٢' and '1_0'
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"{TRACE_STEPS_ENV}={text!r} is not a number of backwards to trace: give a whole "
                         f"number >= 1 (default {DEFAULT_TRACE_STEPS}), or unset it")
    return int(text)


def trace_folder_error(folder: str) -> str | None:
    """Why ``folder`` cannot receive this process's traces, in one line; None when it can (it then exists)."""
    fix = f"give {TRACE_ENV} a folder this process may create and write in, or unset it"
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # what the runner will do at the end: write a file there
            pass
    except OSError as err:
        # the nearest part of the path that exists: a file there is the usual mistake, and worth naming
        there = os.path.abspath(folder)
        while not os.path.lexists(there):
            there = os.path.dirname(there)
        if not os.path.isdir(there):
            where = "is a file" if there == os.path.abspath(folder) else f"is under {there}, a file"
            return f"{TRACE_ENV}={folder} {where}, not a folder: {fix}"
        return f"{TRACE_ENV}={folder}: cannot write there ({err.strerror}): {fix}"
    return None


class _CannotRun(Exception):
    """What ``runpy`` raises when there is no code to run (as opposed to an error inside that code)."""


def module_error(name: str) -> tuple[str, int] | None:
    """Why ``python -m name`` would not start, and its exit status; None when it would.

    Python's own check (``runpy``'s helper for ``-m``): a parent package is imported, and an error raised
    inside one propagates with its traceback, as under ``python -m``."""
    try:
        runpy._get_module_details(name, _CannotRun)
    except _CannotRun as err:
        return str(err), 1
    return None


def path_error(path: str) -> tuple[str, int] | None:
    """Why ``python path`` would not start (no such file; a folder or zip file without ``__main__.py``), and
    its exit status; None when it would."""
    if not os.path.exists(path):
        return f"no such script: {path}", 2
    finder = pkgutil.get_importer(path)  # None for a script; a folder or a zip file has one, as in runpy.run_path
    if finder is not None and finder.find_spec("__main__") is None:
        return f"can't find '__main__' module in {path!r}", 1
    return None
