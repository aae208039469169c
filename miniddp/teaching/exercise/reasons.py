"""Why a spec item failed, in the words a learner can act on: the lines ``check`` prints under FAIL.

What
    ``explain(exc)`` turns a test's exception into a few lines: its type and message (an assertion
    with pytest's line saying what differs), Hypothesis's failing example (an exception note), a
    rank's own exception for a ``RankError``, and where each rank was for a ``RankTimeout``.
    ``case_id`` names the parametrisation that failed; ``where_in_process`` the innermost frames of
    the learner's or miniddp's code in a traceback; ``shorten`` cuts only between words, and says so.

Why
    A spec item runs many cases. "assert [(1, [2.0, 2...]] == [(1, [2.0, 2...]]" cut at 300
    characters, with no example and no case, sends a learner to read the test instead of their code.

How others differ
    pytest's own summary line (``-rA``) is the crash line, cut to the terminal's width; nbgrader
    and CS336's graders print the whole traceback.
"""

from __future__ import annotations

import builtins
import os
import sysconfig
import traceback

LINE_MAX = 1200  # characters: a line kept whole up to this (a diff line of two long lists)
LINES_MAX = 40  # lines per reason
_LIBRARIES = tuple(sorted({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")},
                          key=len, reverse=True))
_GROUP = getattr(builtins, "BaseExceptionGroup", ())  # Python 3.11+
_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the plugin's own frames (the alarm) are not news


def shorten(text: str, limit: int = LINE_MAX) -> str:
    """``text`` whole if it fits, else cut at the last space before ``limit``, saying how much was left out."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    cut = cut if cut > limit // 2 else limit  # one unbroken token: cut it, and say so all the same
    return f"{text[:cut]} [... shortened: {len(text) - cut} more characters]"


def case_id(item, marker: str) -> str:
    """The parametrisation's id without the plugin's own (``marker``), e.g. ``gloo-4``; "" for none."""
    callspec = getattr(item, "callspec", None)
    parts = callspec.id.split("-") if callspec is not None else []
    return "-".join(part for part in parts if part != marker)


def explain(exc: BaseException) -> list[str]:
    """The exception's lines for the report, its notes (Hypothesis's failing example) last, unless it is the
    skeleton's ``NotImplementedError``."""
    notes = list(getattr(exc, "__notes__", []))
    while isinstance(exc, _GROUP) and exc.exceptions:  # several failures (Hypothesis can find more): the first
        exc = exc.exceptions[0]
        notes = [*getattr(exc, "__notes__", []), *notes]
    from miniddp.launching.spawn import RankError, RankTimeout

    text = str(exc)
    if isinstance(exc, RankTimeout):
        lines = text.splitlines()
    elif isinstance(exc, RankError):  # "rank 1 raised X (the others):", then the rank's own exception
        cause = exc.__cause__
        last = [line for line in exc.remote_traceback.splitlines() if line.strip()][-1:]
        lines = [text.splitlines()[0]] + (_message(cause) if cause is not None else last)
    else:
        lines = _message(exc)
    if not isinstance(exc, NotImplementedError):  # a block not written yet fails on any input: no example to show
        lines += [line for note in dict.fromkeys(notes) for line in str(note).splitlines()]
    here = os.getcwd() + os.sep  # the repository, where the spec's files are: their paths read from it
    lines = [shorten(line.replace(here, "")) for line in lines if line.strip()]
    if len(lines) > LINES_MAX:
        lines = lines[:LINES_MAX] + [f"[... shortened: {len(lines) - LINES_MAX} more lines]"]
    return lines


def _message(exc: BaseException) -> list[str]:
    """``Type: message``; of an assertion pytest rewrote, the comparison and the lines saying what differs,
    up to its full diff (a long picture of both sides, after the line that names the difference)."""
    lines = [line.rstrip() for line in str(exc).splitlines()] or [""]
    kept = []
    for line in lines:
        if line.strip().startswith("Full diff:"):
            break
        kept.append(line)
    kept[0] = f"{type(exc).__name__}: {kept[0]}".rstrip(": ")
    return kept


def where_in_process(tb, frames: int = 3) -> list[str]:
    """The innermost frames of ``tb`` outside the libraries and this plugin, with their source lines."""
    ours = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(_LIBRARIES + (_OURS,))]
    ours = [f for f, inner in zip(ours, ours[1:] + [None]) if inner is None or inner.name != f.name]  # decorators
    return [f"  in {f.name} ({_short(f.filename)}:{f.lineno}): {f.line}" for f in reversed(ours[-frames:])]


def _short(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
